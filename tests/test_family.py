"""The family interface (colibri/models/family.py): families are the modules that declare one, under their name."""

import importlib
import pkgutil

import pytest

import colibri.models
from colibri.errors import ColibriError
from colibri.models.family import Family, family, supported


def test_models_holds_only_families():  # shared pieces live in colibri/layers/
    names = set(supported())
    for m in pkgutil.iter_modules(colibri.models.__path__):
        mod = importlib.import_module(f"colibri.models.{m.name}")
        declared = [v for v in vars(mod).values() if isinstance(v, Family)]
        if m.name in names:  # declared as FAMILY, under the module's own name
            assert declared == [mod.FAMILY] and mod.FAMILY.name == m.name, m.name
            assert family(m.name) is mod.FAMILY
        else:
            assert m.name in ("base", "family") and declared == [], m.name
    assert len(names) >= 53 and {"mixtral", "olmoe", "deepseek_v3"} <= names


def test_unknown_model_type_names_the_supported_ones():
    for bad in ("gpt2", "layers", "base", "family", ""):
        with pytest.raises(ColibriError, match=f"unsupported model_type '{bad}' \\(supported: .*mixtral"):
            family(bad)


def test_alias_and_defaults():
    assert family("kimi_k2") is family("deepseek_v3")
    olmoe = family("olmoe")  # declares no conversion hooks: a checkpoint in the canonical layout
    cfg = {"a": 1}
    assert olmoe.flat_config(cfg) is cfg and olmoe.sanitize("x.weight") == "x.weight"
    assert olmoe.source_view("st", cfg) == "st" and olmoe.ignored is None and olmoe.mtp_layers == 0
    olmoe.check_config(cfg)


def test_a_second_declaration_of_a_name_is_refused():
    fam = family("olmoe")
    with pytest.raises(ValueError, match="two families"):
        Family("olmoe", fam.args, fam.model)
