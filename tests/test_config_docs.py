"""docs/configuration.md is generated from the code and must match it."""
from __future__ import annotations

from kvferry import config_docs


def test_configuration_page_is_current() -> None:
    expected = config_docs.render()
    current = config_docs.DOC_PATH.read_text(encoding="utf-8") if config_docs.DOC_PATH.exists() else ""
    assert current == expected, (
        f"{config_docs.DOC_PATH} differs from the code (a flag, an EngineArgs field or an environment "
        f"variable changed): regenerate it with `{config_docs.REGENERATE}` and commit the result")


def test_render_is_deterministic() -> None:
    assert config_docs.render() == config_docs.render()


def test_page_names_every_engine_option_and_serve_flag() -> None:
    import dataclasses

    from kvferry.config import EngineArgs

    text = config_docs.render()
    for f in dataclasses.fields(EngineArgs):
        assert f"`{f.name}`" in text, f.name
    serve = dict((name, sub) for name, sub, _ in config_docs._subcommands(config_docs.kvferry_parser()))["serve"]
    for action in serve._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help") and not flag.startswith("--no-"):
                assert f"`{flag}" in text, flag
