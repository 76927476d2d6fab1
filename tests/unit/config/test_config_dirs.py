"""A user's config dirs beside the package's groups: found, checked, and a bad file named; and
a user package's model family registered through an entry point."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from fsdp_lab.config import ConfigError, compose
from fsdp_lab.config import config_dirs as dirs
from fsdp_lab.config import families as fam


def test_the_package_ships_its_groups_and_templates():
    assert (dirs.CONF_DIR / "config.yaml").is_file()
    assert dirs.shipped("conf/chat_templates/chatml.jinja") == dirs.shipped(
        "chat_templates/chatml.jinja"
    )
    assert dirs.shipped("conf/chat_templates/chatml.jinja").is_file()
    assert dirs.shipped("conf/chat_templates/nope.jinja") is None


def test_dir_flags_are_split_from_the_overrides():
    argv = ["-cd", "a", "model=x", "--config-dir=b", "--config-dir", "c", "-m"]
    assert dirs.split_dir_flags(argv) == (["model=x", "-m"], ["a", "b", "c"])
    with pytest.raises(ConfigError, match="--config-dir needs a directory"):
        dirs.split_dir_flags(["model=x", "--config-dir"])


def test_user_dirs_become_one_searchpath(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = dirs.with_config_dirs(["x=1", f"hydra.searchpath=[file://{tmp_path / 'b'}]"], ["a"])
    assert out[1:] == ["x=1"]
    assert out[0] == f"hydra.searchpath=[file://{tmp_path / 'a'},file://{tmp_path / 'b'}]"
    # a package's configs are Hydra's to find: kept as named; a relative dir made absolute
    out = dirs.with_config_dirs(["+hydra.searchpath=[pkg://my_lab.conf,'b']"], [])
    assert out == [f"hydra.searchpath=[pkg://my_lab.conf,file://{tmp_path / 'b'}]"]
    assert dirs.with_config_dirs(["x=1"], []) == ["x=1"]


def test_a_user_option_composes_and_a_typo_names_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "trainer").mkdir(parents=True)
    (tmp_path / "conf" / "trainer" / "short.yaml").write_text(
        textwrap.dedent(
            """\
            defaults:
              - default
              - _self_
            max_steps: 7
            """
        )
    )
    assert compose(["trainer=short"], ["conf"]).trainer.max_steps == 7
    (tmp_path / "conf" / "trainer" / "short.yaml").write_text("max_stepz: 7\n")
    bad = tmp_path / "conf" / "trainer" / "short.yaml"
    with pytest.raises(ConfigError, match=rf"^{bad}: Key 'max_stepz' not in 'TrainerConfig'"):
        compose(["trainer=short"], ["conf"])
    with pytest.raises(ConfigError, match="--config-dir nope: no such directory"):
        compose([], ["nope"])
    with pytest.raises(ConfigError, match=r"Available options in 'sharding': full, grad_op"):
        compose(["sharding=zero3"])
    # An option named as a shipped one: Hydra would read the shipped file and pass this over.
    (tmp_path / "conf" / "trainer" / "default.yaml").write_text("max_steps: 7\n")
    own = tmp_path / "conf" / "trainer" / "default.yaml"
    with pytest.raises(ConfigError, match=rf"^{own}: fsdp_lab ships .*trainer/my_default.yaml"):
        compose([], ["conf"])
    own.unlink()
    (tmp_path / "conf" / "config.yaml").write_text("seed: 3\n")  # a copy of the primary config
    with pytest.raises(ConfigError, match=r"config.yaml is the one composed.*experiment=my_run"):
        compose([], ["conf"])


class _EntryPoint:
    def __init__(self, value, loaded):
        self.name, self.value, self._loaded = "mine", value, loaded

    def load(self):
        return self._loaded


def test_a_user_packages_family_registers_through_its_entry_point(monkeypatch):
    row = fam.Family("phi3", fam.Activations.llama, fused_loss=True)
    points = [_EntryPoint("my_lab.families:PHI3", row)]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: points)
    monkeypatch.setattr(fam, "FAMILIES", dict(fam.FAMILIES))
    fam._plug_in.cache_clear()
    assert fam.family_of("phi3") is row and "phi3" in fam.fused_loss_types()
    # a row for a type fsdp_lab has, or something that is not a row: one line naming it
    other_llama = dataclasses.replace(fam.FAMILIES["llama"], fused_loss=False)
    for loaded, fragment in ((other_llama, "which fsdp_lab has a row for"), ("x", "not a fsdp")):
        fam._plug_in.cache_clear()
        points[:] = [_EntryPoint("my_lab:X", loaded)]
        with pytest.raises(ConfigError, match=f"entry point mine = my_lab:X .*{fragment}"):
            fam.family_of("llama")
