"""Resolving model names offline: catalog, local paths, the HF cache, and clear errors for everything else."""

from __future__ import annotations

import json

import pytest

from graphs import MalformedConfig, UnknownModel, UnsupportedModel, lower, resolve


def test_resolve_catalog_id_and_bare_name():
    assert resolve("meta-llama/Llama-3.1-8B").source == "catalog"
    assert resolve("Llama-3.1-8B").id == "meta-llama/Llama-3.1-8B"


def test_resolve_local_directory_and_config_file(tmp_path):
    values = resolve("gpt2").as_dict()
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert resolve(str(tmp_path)).source == "local"
    assert resolve(str(tmp_path / "config.json")).as_dict() == values


def test_resolve_hf_cache_entry_without_network(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(json.dumps(resolve("gpt2").as_dict()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    found = resolve("acme/tiny")
    assert found.source == "hf-cache" and found.as_dict()["n_layer"] == 12


def test_unknown_model_lists_closest_catalog_ids():
    with pytest.raises(UnknownModel) as err:
        resolve("meta-llama/Llama-3.1-8")
    assert "meta-llama/Llama-3.1-8B" in err.value.hint


def test_unknown_model_without_close_ids_points_to_the_catalog():
    with pytest.raises(UnknownModel) as err:
        resolve("nope/model")
    assert "Closest" not in err.value.hint and "fitplan models" in err.value.hint


def test_malformed_json_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(MalformedConfig) as err:
        resolve(str(bad))
    assert str(bad) in err.value.message


def test_config_with_bad_field_names_the_field(tmp_path):
    values = {**resolve("gpt2").as_dict(), "n_layer": -3}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(MalformedConfig) as err:
        resolve(str(tmp_path))
    assert "'n_layer'" in err.value.message


def test_config_without_model_type_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(MalformedConfig, match="model_type"):
        resolve(str(tmp_path))


def test_unknown_architecture_names_its_model_type_and_never_runs_remote_code(tmp_path):
    values = {"model_type": "acme_lm", "auto_map": {"AutoModelForCausalLM": "modeling_acme.AcmeLM"}}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(UnsupportedModel) as err:
        lower(str(tmp_path))
    assert "acme_lm" in err.value.message and "remote code" in err.value.message


def test_local_model_given_relative_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    """Issue 38 item 12: `./tiny-llama` recorded as given is "Unknown model" from any other folder."""
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps(resolve("gpt2").as_dict()))
    monkeypatch.chdir(tmp_path)
    for given in ("./tiny-llama", "tiny-llama", "tiny-llama/config.json"):
        resolved = resolve(given)
        assert resolved.id == str((tmp_path / given).resolve()), given
    monkeypatch.chdir(tmp_path.parent)
    assert resolve(resolve("./" + tmp_path.name + "/tiny-llama").id).source == "local"
