"""``m3stack gateway``: configuration errors exit with code 2 and say what to fix; every media limit flag
reaches the MediaLimits the gateway runs with."""

import argparse
import dataclasses
import http.client
import logging
import subprocess
import sys
import time

import pytest

from m3stack import options
from m3stack.cli import build_parser
from m3stack.gateway import cli
from m3stack.gateway.multimodal import MediaLimits
from m3stack.local.processes import free_port
from m3stack.options import OptionGroup

LOOPBACK = "127.0.0.1"


def parse(args: list[str]):
    parser = argparse.ArgumentParser(prog="m3stack gateway")
    cli.add_arguments(OptionGroup(parser, "gateway"))
    return parser.parse_args(args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engines", "127.0.0.1:1"], "--model is required"),
        (["--model", "/nonexistent/folder", "--engines", "127.0.0.1:1"], "not a folder"),
        (["--model", "{model}"], "exactly one of --engines and --engine-service"),
        (["--model", "{model}", "--engines", "127.0.0.1:1", "--engine-service", "engines:1"], "exactly one"),
        (["--model", "{empty}", "--engines", "127.0.0.1:1"], "no tokenizer.json"),
    ],
)
def test_configuration_errors_return_2(tiny_model_dir, tmp_path, caplog, args, message):
    filled = [a.format(model=tiny_model_dir, empty=tmp_path) for a in args]
    with caplog.at_level(logging.ERROR):
        assert cli.run(parse(filled)) == 2
    assert message in caplog.text


def test_model_default_is_the_tiny_model_the_engine_uses(tiny_model_dir, monkeypatch):
    # The engine's `--model default` is ensure_tiny_checkpoint() under $M3STACK_CACHE: the gateway reads that folder.
    monkeypatch.setenv("M3STACK_CACHE", str(tiny_model_dir.parents[1]))
    config = cli.build_config(parse(["--model", "default", "--engines", "127.0.0.1:1"]))
    assert config.model_dir == tiny_model_dir.resolve()
    assert config.served_model_name == tiny_model_dir.name


def test_model_default_without_the_tiny_model_says_how_to_make_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("M3STACK_CACHE", str(tmp_path))
    with caplog.at_level(logging.ERROR):
        assert cli.run(parse(["--model", "default", "--engines", "127.0.0.1:1"])) == 2
    assert "--model default: the tiny default model is not in" in caplog.text
    assert "m3stack model init-tiny" in caplog.text


def test_the_command_exits_2_with_the_message(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "m3stack", "gateway", "--model", str(tiny_model_dir), "--engines", "no-port"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "HOST:PORT" in result.stderr


# Every media limit the gateway takes from its command line: flag, MediaLimits field, a value other than the
# default, and what the field should then hold.  Written out (not read from limits.py) so that a flag that
# goes missing or stops reaching MediaLimits fails here.
MEDIA_FLAGS = [
    ("--media-max-images", "max_images", "3", 3),
    ("--media-max-videos", "max_videos", "0", 0),
    ("--media-max-image-bytes", "max_image_bytes", "1000", 1000),
    ("--media-max-video-bytes", "max_video_bytes", "2000", 2000),
    ("--media-fetch-timeout", "fetch_timeout_s", "2.5", 2.5),
    ("--media-connect-timeout", "connect_timeout_s", "0.5", 0.5),
    ("--media-max-redirects", "max_redirects", "0", 0),
    ("--media-allowed-domains", "allowed_domains", "Example.com., cdn.test", ("example.com", "cdn.test")),
    ("--media-local-dir", "local_media_dir", "/srv/media", "/srv/media"),
    ("--media-max-image-pixels", "max_image_pixels", "4096", 4096),
    ("--media-max-video-frame-pixels", "max_video_frame_pixels", "5000", 5000),
    ("--media-max-video-frames", "max_video_frames", "600", 600),
    ("--media-max-video-seconds", "max_video_seconds", "90.5", 90.5),
    ("--media-max-decoded-frames", "max_decoded_frames", "300", 300),
    ("--media-max-sampled-frames", "max_sampled_frames", "32", 32),
    ("--media-max-video-pixels", "max_video_pixels", "70000", 70000),
    ("--media-job-timeout", "job_timeout_s", "7", 7.0),
    ("--media-decode-threads", "decode_threads", "4", 4),
]
# The decoder allowlists have no flags: widening them is a code change, not a setting.
NOT_FLAGS = {"image_formats", "video_containers", "video_codecs"}


def _gateway_limits(model_dir, *flags: str) -> MediaLimits:
    """Parse with the real ``m3stack`` parser and build the config the gateway runs with."""
    args = build_parser().parse_args(["gateway", "--model", str(model_dir), "--engines", "127.0.0.1:1", *flags])
    return cli.build_config(args).media_limits


def test_every_media_limit_has_a_flag():
    fields = {f.name for f in dataclasses.fields(MediaLimits)} - NOT_FLAGS
    assert fields == {field for _, field, _, _ in MEDIA_FLAGS} | {"allow_private_networks"}


def test_without_flags_the_gateway_uses_the_default_limits(tiny_model_dir):
    assert _gateway_limits(tiny_model_dir) == MediaLimits()


@pytest.mark.parametrize("source", ["flag", "environment"])
@pytest.mark.parametrize(("flag", "field", "text", "expected"), MEDIA_FLAGS, ids=[row[0] for row in MEDIA_FLAGS])
def test_each_media_flag_reaches_the_limits(tiny_model_dir, monkeypatch, source, flag, field, text, expected):
    assert getattr(MediaLimits(), field) != expected
    if source == "flag":
        limits = _gateway_limits(tiny_model_dir, flag, text)
    else:
        monkeypatch.setenv(options.env_name("gateway", flag), text)
        limits = _gateway_limits(tiny_model_dir)
    assert getattr(limits, field) == expected
    assert dataclasses.replace(limits, **{field: getattr(MediaLimits(), field)}) == MediaLimits()  # nothing else


def test_allow_private_networks_by_flag_and_environment(tiny_model_dir, monkeypatch):
    assert _gateway_limits(tiny_model_dir, "--media-allow-private-networks").allow_private_networks
    monkeypatch.setenv("M3STACK_GATEWAY_MEDIA_ALLOW_PRIVATE_NETWORKS", "yes")
    assert _gateway_limits(tiny_model_dir).allow_private_networks
    assert not _gateway_limits(tiny_model_dir, "--no-media-allow-private-networks").allow_private_networks


def test_the_flag_wins_over_the_environment(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("M3STACK_GATEWAY_MEDIA_MAX_IMAGES", "5")
    assert _gateway_limits(tiny_model_dir, "--media-max-images", "7").max_images == 7


NUMERIC_FLAGS = [row[0] for row in MEDIA_FLAGS if not isinstance(row[3], (str, tuple))]


@pytest.mark.parametrize("flag", NUMERIC_FLAGS)
def test_a_bad_media_value_exits_2_naming_the_flag(tiny_model_dir, monkeypatch, capsys, flag):
    with pytest.raises(SystemExit) as by_flag:
        _gateway_limits(tiny_model_dir, flag, "-1")
    assert by_flag.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err
    variable = options.env_name("gateway", flag)
    monkeypatch.setenv(variable, "lots")
    with pytest.raises(SystemExit) as by_variable:
        _gateway_limits(tiny_model_dir)
    assert by_variable.value.code == 2 and f"environment variable {variable}='lots'" in capsys.readouterr().err


def test_the_command_exits_2_on_a_bad_media_limit():
    result = subprocess.run(
        [sys.executable, "-m", "m3stack", "gateway", "--media-max-sampled-frames", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--media-max-sampled-frames" in result.stderr and "expected an integer > 0" in result.stderr


def test_idle_connections_stay_open_for_the_keep_alive_timeout_and_close_after_it(tiny_model_dir):
    """uvicorn's default (5 s) closes idle connections while proxies in front still reuse them (an Ingress keeps
    upstream connections 60 s); the gateway's default outlasts that, and ``--keep-alive-timeout`` reaches the server."""
    assert parse([]).keep_alive_timeout > 60
    port = free_port(LOOPBACK)
    args = ["gateway", "--model", str(tiny_model_dir), "--engines", "127.0.0.1:1", "--host", LOOPBACK, "--port",
            str(port), "--keep-alive-timeout", "1.5"]  # fmt: skip
    gateway = subprocess.Popen([sys.executable, "-m", "m3stack", *args])
    try:
        deadline = time.monotonic() + 60
        while True:  # until the server listens
            connection = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
            try:
                connection.request("GET", "/health")
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        time.sleep(0.5)
        connection.request("GET", "/health")  # the same connection, idle for less than the timeout
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        time.sleep(2.5)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            connection.request("GET", "/health")
            connection.getresponse()
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
