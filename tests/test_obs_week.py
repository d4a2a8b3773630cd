"""What a ModelArts user reading ``obs://`` meets, beyond tests/test_obs_store.py: URLs with odd
characters, the repr of a pipeline's settings, the messages of a wrong region and of missing
credentials. Against the moto server, through the OBS SDK; faults from tests/faultproxy.py."""

from __future__ import annotations

import pytest

pytest.importorskip("obs")

from test_obs_store import clean_obs_env  # noqa: F401 - autouse: no OBS_* variable of the shell in a test

from cachepipe.errors import ConfigError
from cachepipe.stores.obs import ObsStore

BUCKET = "obs-week"
SECRET = "sk-Week-Secret-0123456789"


@pytest.fixture
def options(s3_endpoint: str) -> dict:
    return {"server": s3_endpoint, "access_key_id": "AKWEEK", "secret_access_key": SECRET}


@pytest.fixture
def bucket(s3_client) -> str:
    s3_client.create_bucket(Bucket=BUCKET)
    return BUCKET


@pytest.mark.parametrize("bucket_name", ["my bucket", "my\tbucket", "my%20bucket", "bücket"])
def test_a_bucket_name_no_bucket_can_have_is_refused_at_once_naming_it(options: dict, bucket_name: str) -> None:
    # a space reached the request line unquoted: http.client refused it, and the listing was
    # retried as an endpoint it could not reach; a tab was dropped (the bucket 'mybucket' read)
    with pytest.raises(ConfigError, match="bucket name") as info:
        ObsStore(f"obs://{bucket_name}/video/", options)
    assert repr(bucket_name) in str(info.value)


def test_a_prefix_holding_a_tab_lists_its_own_objects_not_those_of_the_prefix_without_it(
    options: dict, s3_client, bucket: str
) -> None:
    s3_client.put_object(Bucket=bucket, Key="video/tab\tx/f", Body=b"mine")
    s3_client.put_object(Bucket=bucket, Key="video/tabx/g", Body=b"not mine")
    with ObsStore(f"obs://{bucket}/video/tab\tx/", options) as store:
        assert store.prefix == "video/tab\tx/"
        assert [info.key for info in store.list()] == ["f"]


def test_a_pipeline_s_settings_shown_in_a_notebook_hold_no_credentials(tmp_path) -> None:
    # a notebook shows the value of a cell's last expression: `pipe.config` showed storage_options whole
    from cachepipe import PipelineConfig

    obs = {"server": "https://obs.example", "access_key_id": "AKWEEK", "secret_access_key": SECRET}
    obs |= {"security_token": "tok-Week-Secret-abcdef", "proxy_password": "proxy-Week-Secret"}
    s3 = {"endpoint_url": "http://127.0.0.1:9", "key": "AKWEEK", "secret": SECRET, "token": "tok-Week-Secret-abcdef"}
    for source, options in (("obs://b/video/", obs), ("s3://b/video/", s3)):
        cfg = PipelineConfig(source=source, cache_dir=tmp_path, capacity="1MB", storage_options=options)
        for shown in (repr(cfg), str(cfg)):
            assert "Week-Secret" not in shown
            assert source in shown  # the rest is shown as before
        assert cfg.storage_options == options  # kept whole for the store


@pytest.fixture
def proxied(fault_proxy, s3_client, bucket: str) -> tuple:
    """The fault proxy before the moto server, and storage options with explicit keys through it."""
    s3_client.put_object(Bucket=bucket, Key="video/item/f", Body=b"data")
    proxy, endpoint = fault_proxy
    return proxy, {"server": endpoint, "access_key_id": "AKWEEK", "secret_access_key": SECRET}


def test_a_bucket_in_another_region_says_to_set_the_endpoint_of_its_region(proxied, bucket: str) -> None:
    # OBS answers 301 PermanentRedirect for a bucket of another region (the SDK follows a Location
    # header where there is one): the message was the permanent 'refused listing' and the code alone
    proxy, options = proxied
    proxy.inject("redirect", 1)
    with ObsStore(f"obs://{bucket}/video/", options) as store, pytest.raises(OSError, match="another region") as info:
        list(store.list())
    assert "OBS_ENDPOINT" in str(info.value) and "PermanentRedirect" in str(info.value)
    assert not isinstance(info.value, ConnectionError)  # not retried


class _NoCredentials:
    """An SDK credential provider that has none (as the ECS metadata provider off ModelArts)."""

    @staticmethod
    def search() -> dict:
        raise LookupError("no credentials here")


def test_access_denied_with_no_keys_given_says_the_providers_may_have_found_none(proxied, bucket: str) -> None:
    # with no keys given, the SDK asks its providers on each request and, when none has any, sends
    # the request unsigned: OBS's AccessDenied then was reported as credentials 'accepted but lack
    # permission', with nothing on how to give keys off ModelArts
    proxy, options = proxied
    proxy.inject("403", 1)
    found_none = {"server": options["server"], "security_providers": [_NoCredentials]}  # not ECS metadata: no request to it
    with ObsStore(f"obs://{bucket}/video/", found_none) as store:
        assert store.credential_source == "provider"
        with pytest.raises(PermissionError, match="found none") as info:
            list(store.list())
    assert "OBS_ACCESS_KEY_ID" in str(info.value) and "accepted" not in str(info.value)


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("options", "access_key_id", "AK\u2013WEEK"),  # an en dash, pasted from a web page
        ("options", "security_token", "tok-Week-Secret\u00a0abc"),  # a no-break space
        ("env", "secret_access_key", "sk-Week-Secret-0123\r"),  # a .env file with CRLF line ends
    ],
)
def test_a_credential_holding_a_character_no_key_has_is_refused_naming_where_it_came_from(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, where: str, key: str, value: str
) -> None:
    # a non-Latin-1 character failed at the first request as a bare UnicodeEncodeError ("'latin-1'
    # codec can't encode character '\u2013' in position 6"); a CR was sent into the signature
    creds = {"access_key_id": "AKWEEK", "secret_access_key": SECRET} | {key: value}
    options = {"server": s3_endpoint}
    if where == "options":
        options |= creds
        named = f"storage_options[{key!r}]"
    else:
        for name, env in (("access_key_id", "OBS_ACCESS_KEY_ID"), ("secret_access_key", "OBS_SECRET_ACCESS_KEY")):
            monkeypatch.setenv(env, creds[name])
        named = "$OBS_SECRET_ACCESS_KEY"
    with pytest.raises(ConfigError) as info:
        ObsStore("obs://b/video/", options)
    assert named in str(info.value) and "ASCII" in str(info.value)
    assert value not in str(info.value) and "Week-Secret" not in str(info.value)
