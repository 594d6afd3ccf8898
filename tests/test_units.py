import pytest

from memkit.errors import ConfigError
from memkit.units import format_size, parse_size, size_option


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 1024**3),
        ("8G", 8 * 1024**3),
        ("8g", 8 * 1024**3),
        ("8GB", 8 * 1000**3),
        ("512MiB", 512 * 1024**2),
        ("512M", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1.5 GiB", int(1.5 * 1024**3)),
        ("1024", 1024),
        ("1024B", 1024),
        ("4k", 4096),
        ("4kB", 4000),
        ("2TiB", 2 * 1024**4),
        (" 300MiB ", 300 * 1024**2),
        (123, 123),
    ],
)
def test_parse_size_accepts_documented_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "8 parsecs", "-1GiB", "1.2.3G", "eight"])
def test_parse_size_rejects_bad_text_naming_it_and_the_forms(bad):
    with pytest.raises(ConfigError) as info:
        parse_size(bad)
    message = str(info.value)
    assert repr(bad) in message or bad.strip() in message
    assert "GiB" in message  # lists the accepted forms


def test_parse_size_rejects_negative_and_bool():
    with pytest.raises(ConfigError):
        parse_size(-5)
    with pytest.raises(ConfigError):
        parse_size(True)


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (3 * 1024**3, "3.00 GiB"), (None, "n/a")],
)
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_size_signed_and_roundtrip():
    assert format_size(2048, signed=True) == "+2.00 KiB"
    assert format_size(-2048, signed=True) == "-2.00 KiB"
    assert parse_size(format_size(5 * 1024**2).replace(" ", "")) == 5 * 1024**2


@pytest.mark.parametrize(
    ("n", "text"), [(8 << 20, "8MiB"), (3 << 30, "3GiB"), (1536, "1536"), (0, "0"), (999, "999")]
)
def test_size_option_is_exact_and_reads_back(n, text):
    """What advice puts in a command (``--budget 8MiB``, not ``--budget 8388608``)."""
    assert size_option(n) == text
    assert parse_size(size_option(n)) == n


def test_a_budget_without_a_unit_too_small_for_any_tensor_is_taken_for_a_forgotten_unit():
    """``budget=12`` made a 12-byte device, whose post-mortem then advised sharding an
    80-byte Linear (sweep KK)."""
    import memkit
    from memkit.units import parse_budget

    with pytest.raises(ConfigError, match=r"budget=12: 12 is 12 bytes .* e\.g\. '12GiB'"):
        memkit.simulate(12)
    with pytest.raises(ConfigError, match=r"budget='12': .*12 bytes"):  # noqa: SIM117
        with memkit.track(None, device="cpu", budget="12"):
            pass
    with pytest.raises(ConfigError, match=r"budget=24.0: 24.0 is 24 bytes"):
        memkit.simulate(24.0)
    assert parse_budget(1000) == 1000  # a tiny device in bytes, on purpose (review)
    assert parse_budget(0.9 * 64 * 2**20) == 60397978  # a computed budget: rounded (review)
    assert parse_budget("100B") == 100  # a unit given: taken as written
