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


def test_config_defaults(tmp_path):
    cfg = PipelineConfig(source="s3://b/p", cache_dir=tmp_path, capacity="1g")
    assert cfg.capacity == 1024**3 and cfg.items == "folders" and cfg.ordered and cfg.auto_ack
    assert cfg.part_size is None and cfg.max_concurrency == 64 and cfg.max_large_requests == 16 and cfg.prefetch is None
    assert cfg.large_requests == 16 and cfg.model_copy(update={"max_concurrency": 4}).large_requests == 4
