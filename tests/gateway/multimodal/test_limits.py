"""Media limits as gateway flags and M3STACK_GATEWAY_MEDIA_* variables."""

import argparse

import pytest

from m3stack.gateway.multimodal import MediaLimits
from m3stack.gateway.multimodal import limits as media_limits
from m3stack.options import OptionGroup


def _parse(argv: list[str]) -> MediaLimits:
    parser = argparse.ArgumentParser()
    media_limits.add_arguments(OptionGroup(parser, "gateway"))
    return media_limits.from_args(parser.parse_args(argv))


def test_defaults_are_the_dataclass_defaults():
    assert _parse([]) == MediaLimits()
    assert MediaLimits().max_image_pixels == 3584 * 3584 and MediaLimits().max_video_pixels == 301_056_000


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("M3STACK_GATEWAY_MEDIA_MAX_VIDEOS", "1")
    monkeypatch.setenv("M3STACK_GATEWAY_MEDIA_ALLOW_PRIVATE_NETWORKS", "true")
    parsed = _parse(
        ["--media-max-images", "3", "--media-allowed-domains", "Example.com., cdn.test", "--media-job-timeout", "2.5"]
    )
    assert (parsed.max_images, parsed.max_videos, parsed.job_timeout_s) == (3, 1, 2.5)
    assert parsed.allowed_domains == ("example.com", "cdn.test") and parsed.allow_private_networks


def test_bad_values_exit_with_code_2(monkeypatch, capsys):
    with pytest.raises(SystemExit) as flag_error:
        _parse(["--media-max-image-pixels", "0"])
    assert flag_error.value.code == 2 and "expected an integer > 0" in capsys.readouterr().err
    monkeypatch.setenv("M3STACK_GATEWAY_MEDIA_FETCH_TIMEOUT", "soon")
    with pytest.raises(SystemExit) as env_error:
        _parse([])
    assert env_error.value.code == 2 and "M3STACK_GATEWAY_MEDIA_FETCH_TIMEOUT" in capsys.readouterr().err
