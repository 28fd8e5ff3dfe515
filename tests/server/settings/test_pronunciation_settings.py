"""``server.pronunciations``: lines or a mapping, in settings.yaml, a config file or ``--set``;
a value of the wrong shape is refused naming its key. What an entry says is the engine's to
check (tests/engine_tests/text/test_pronunciations.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wyoming_cosyvoice.__main__ import build_parser, config_from_args
from wyoming_cosyvoice.config import ConfigError, load_config, packaged_settings


def test_none_by_default() -> None:
    assert packaged_settings()["server"]["pronunciations"] == []
    assert load_config().pronunciations == ()


def test_lines_as_given_without_blank_ones() -> None:
    lines = [" Michael = M AY1 K AH0 L ", "", "  ", "张三 = zhang1 san1"]
    config = load_config(None, [("server.pronunciations", lines)])
    assert config.pronunciations == ("Michael = M AY1 K AH0 L", "张三 = zhang1 san1")


def test_one_line_as_text() -> None:
    config = load_config(None, [("server.pronunciations", "Niamh = Neev")])
    assert config.pronunciations == ("Niamh = Neev",)


def test_a_mapping_in_a_config_file_reads_as_lines(tmp_path: Path) -> None:
    saved = tmp_path / "server.yaml"
    saved.write_text(
        "server:\n  pronunciations:\n    Siobhan: SH IH0 V AO1 N | Shivawn\n    张三: zhāng sān\n",
        encoding="utf-8",
    )
    assert load_config(saved).pronunciations == (
        "Siobhan = SH IH0 V AO1 N | Shivawn",
        "张三 = zhāng sān",
    )


def test_a_line_the_engine_will_refuse_is_still_a_setting() -> None:
    """The server starts with it, logs why, and applies the rest."""
    args = build_parser().parse_args(["--set", 'server.pronunciations=["no equals sign"]'])
    assert config_from_args(args).pronunciations == ("no equals sign",)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (3, "server.pronunciations"),
        (["Michael = M AY1", 3], "server.pronunciations[1]"),
        ({"Michael": 3}, "server.pronunciations.Michael"),
        ({"Michael": None}, "server.pronunciations.Michael"),
    ],
)
def test_a_value_of_the_wrong_shape_names_its_key(value: object, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [("server.pronunciations", value)])
    assert err.value.key == named
