import pytest
from pydantic import ValidationError

from cachepipe.config import PipelineConfig, Share, parse_capacity, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1, 1),
        (4096, 4096),
        ("4096", 4096),
        ("50GiB", 50 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("512M", 512 * 1024**2),
        ("512MiB", 512 * 1024**2),
        ("1g", 1024**3),
        ("2k", 2048),
        ("10KB", 10_000),
        ("3 MB", 3_000_000),
        ("1T", 1024**4),
        ("100b", 100),
        (2.5e3, 2500),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["10X", -1, 0, "abc", "", "0", "-5M", "1.2.3G", True, None, float("nan"), float("inf"), [1], "GiB"]
)
def test_bad_sizes_name_value_and_forms(bad):
    with pytest.raises(ValueError) as info:  # noqa: PT011 - any error of this type is what the test expects
        parse_capacity(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert "50GiB" in message and "80%" in message


@pytest.mark.parametrize(("text", "fraction"), [("80%", 0.8), ("100%", 1.0), (" 5.5 %", 0.055)])
def test_share(text, fraction):
    share = parse_capacity(text)
    assert isinstance(share, Share) and share.fraction == pytest.approx(fraction)


@pytest.mark.parametrize("bad", ["0%", "101%", "-3%", "x%", "%"])
def test_bad_share(bad):
    with pytest.raises(ValueError, match="share"):
        parse_capacity(bad)


def test_config_rejects_bad_values_with_field_names(tmp_path):
    with pytest.raises(ValidationError) as info:
        PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="10X")
    assert "capacity" in str(info.value) and "'10X'" in str(info.value)
    assert isinstance(info.value, ValueError)
    for field, value in [
        ("items", "dirs"),
        ("on_error", "ignore"),
        ("max_concurrency", 0),
        ("max_large_requests", 0),
        ("prefetch", 0),
        ("part_size", "1Q"),
        ("retries", -1),
    ]:
        with pytest.raises(ValidationError) as info:
            PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="1G", **{field: value})
        assert field in str(info.value)


def test_an_option_given_as_a_share_or_a_number_is_named_in_its_error(tmp_path):
    with pytest.raises(ValidationError, match=r"min_free '200%': expected .*a share between 0% and 100%"):
        PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="1G", min_free="200%")
    for field in ("retry_backoff", "lease_timeout", "unpack_ratio"):  # not a range's message: "a finite number"
        with pytest.raises(ValidationError, match=rf"{field}\n  Input should be a finite number"):
            PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="1G", **{field: float("nan")})


def test_config_rejects_unknown_option(tmp_path):
    with pytest.raises(ValidationError, match="capactiy"):
        PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="1G", capactiy=3)


@pytest.mark.parametrize(
    "given",
    [
        {"storage_options": ["key", "AKIAEXAMPLE", "secret", "s3cr3t"]},  # a list instead of a mapping
        {"storage_options": "key=AKIAEXAMPLE secret=s3cr3t"},  # a string holding the key
        {"storage_options": {"key": "AKIAEXAMPLE", 5: "s3cr3t"}},  # a key that is no name
        {"storage_option": {"key": "AKIAEXAMPLE", "secret": "s3cr3t"}},  # misspelt: an unknown key
        {"storage_options": ("s3cr3t",), "capacity": "10X"},  # with another error, whose value is hidden too
    ],
)
def test_storage_options_of_a_wrong_type_are_not_echoed(tmp_path, given):
    """pydantic's message shows each error's input: ``storage_options`` given as a list or a
    string showed the secret key in the exception (in a notebook, in a job's log)."""
    from cachepipe import Pipeline
    from cachepipe.map.plan import MapConfig

    options = {"capacity": "1G", **given}
    with pytest.raises(ValidationError) as info:
        PipelineConfig(source="s3://b/p", cache_dir=tmp_path, **options)
    shown = f"{info.value}\n{info.value.errors()}"
    assert "storage_option" in shown and "s3cr3t" not in shown and "AKIAEXAMPLE" not in shown, shown
    if "storage_options" in given:
        with pytest.raises(ValidationError) as info:
            Pipeline("s3://b/p", tmp_path / "c", **options)
        assert "storage_options" in str(info.value) and "s3cr3t" not in str(info.value), info.value
        with pytest.raises(ValidationError) as info:
            MapConfig(source="s3://b/p", dest="s3://b/q", cache_dir=tmp_path, **options)
        assert "storage_options" in str(info.value) and "s3cr3t" not in str(info.value), info.value
    with pytest.raises(ValidationError, match=r"input_value='10X'"):  # other errors keep their value
        PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="10X", storage_options={"secret": "s3cr3t"})


@pytest.mark.parametrize("name", ["secret", "aws_secret_access_key", "storage_option"])
def test_a_credential_given_beside_the_options_is_not_echoed(tmp_path, name):
    """s3fs takes ``key=`` and ``secret=``; given to ``Pipeline`` (or to the torch dataset, or
    to ``MapConfig``) where only ``storage_options`` takes them, the unknown option's error
    showed the secret: ``secret='s3cr3t' is not an option of Pipeline``. An unknown option's
    number keeps being shown."""
    from cachepipe import Pipeline
    from cachepipe.errors import ConfigError
    from cachepipe.map.plan import MapConfig

    with pytest.raises(ConfigError, match=rf"^{name} \(its value not shown\) is not an option of Pipeline") as info:
        Pipeline("s3://b/p", tmp_path / "c", "1G", **{name: "s3cr3t"})
    shown = [str(info.value)]
    for make, where in ((PipelineConfig, {}), (MapConfig, {"dest": "s3://b/q"})):
        with pytest.raises(ValidationError, match=name) as caught:
            make(source="s3://b/p", cache_dir=tmp_path, capacity="1G", **where, **{name: "s3cr3t"})
        shown.append(f"{caught.value}\n{caught.value.errors()}")
    assert not [text for text in shown if "s3cr3t" in text], shown
    with pytest.raises(ConfigError, match="max_concurency=4 is not an option of Pipeline; did you mean 'max_concurrency'"):
        Pipeline("s3://b/p", tmp_path / "c", "1G", max_concurency=4)


def test_config_defaults(tmp_path):
    cfg = PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="1g")
    assert cfg.capacity == 1024**3 and cfg.items == "folders" and cfg.ordered and cfg.auto_ack
    assert cfg.part_size is None and cfg.max_concurrency == 64 and cfg.max_large_requests == 16 and cfg.prefetch is None
    assert cfg.large_requests == 16 and cfg.model_copy(update={"max_concurrency": 4}).large_requests == 4


def test_a_cache_dir_inside_a_local_source_is_refused_naming_both(tmp_path):
    """The source's listing held the cache's own folder as an item of the dataset (a
    ``cache_dir`` of ``src/cache`` handed out ``cache``, its lock and journal copied into
    itself); refused at once, as spelled or through a link."""
    (tmp_path / "src").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "src", target_is_directory=True)
    inside = [
        ("file://" + str(tmp_path / "src") + "/", tmp_path / "src" / "cache"),
        (str(tmp_path / "src"), tmp_path / "src"),
        (str(tmp_path / "link"), tmp_path / "src" / "deeper" / "cache"),
    ]
    for source, cache in inside:
        with pytest.raises(ValidationError, match=f"{str(cache)!r} is inside the source {source!r}"):
            PipelineConfig(source=source, cache_dir=cache, capacity="1G")
    for source, cache in [(str(tmp_path / "src"), tmp_path / "srcx"), ("s3://b/p", tmp_path / "src" / "cache")]:
        assert PipelineConfig(source=source, cache_dir=cache, capacity="1G").cache_dir == cache
