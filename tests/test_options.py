"""One options model per stage, used everywhere: CLI flags, flow parameters and prefect.yaml all map onto it."""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from pathlib import Path

import pytest
import yaml

from elmo_core.cli import COMMANDS, build_parser, parse_config
from elmo_core.config import PRESETS, PresetName
from elmo_core.errors import ConfigError
from elmo_core.options import CPU_TRAIN_OPTIONS, EmbedOptions, IngestOptions, TrainConfig, TrainOptions
from elmo_core.text.tokenize import TokenizerName

ROOT = Path(__file__).resolve().parent.parent
NOT_FIELDS = {"help", "config", "plan"}  # the flags every command adds (--plan: every stage's)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_cli_flag_is_a_field_and_every_field_a_flag():
    commands = _subparsers(build_parser())
    probes = _subparsers(commands.pop("probe"))
    pairs = [(COMMANDS[name][0], command) for name, command in commands.items()]
    pairs += [(COMMANDS[f"probe {name}"][0], command) for name, command in probes.items()]
    assert len(pairs) == len(COMMANDS)  # every registered command has its parser, and no other
    for model, command in pairs:
        name = command.prog
        dests = {a.dest for a in command._actions} - NOT_FIELDS
        assert dests == set(model.model_fields), name
        for action in command._actions:
            if action.dest in model.model_fields:
                printed = action.help % {}  # as argparse prints it ("2%%" reads "2%")
                assert printed.startswith(model.model_fields[action.dest].description), (name, action.dest)


def test_defaults_then_config_file_then_flags(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"data": "d", "out": "o", "batch_size": 7, "unroll_steps": 5}))
    args = build_parser().parse_args(
        [
            "train",
            "--config",
            str(config),
            "--batch-size",
            "9",
            "--no-resume",
            "--model",
            '{"lstm": {"dim": 32, "projection_dim": 8}, "char_cnn": {"filters": [[1, 8]]}}',
        ]
    )
    options = parse_config(TrainConfig, args)
    assert (options.batch_size, options.unroll_steps, options.dropout) == (9, 5, 0.1)  # flag, file, default
    assert options.model.lstm.dim == 32 and options.architecture().lstm.projection_dim == 8
    with pytest.raises(ConfigError, match=r"--batch-size: Input should be greater than 0 \(got -1\)"):
        parse_config(
            TrainConfig, build_parser().parse_args(["train", "--data", "d", "--out", "o", "--batch-size", "-1"])
        )
    with pytest.raises(ConfigError, match="--out: Field required"):
        parse_config(TrainConfig, build_parser().parse_args(["train", "--data", "d"]))


def test_a_config_file_s_bad_value_is_named_by_its_key_in_that_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": "d", "out": "o", "batch_size": -3, "unrol_steps": 5}')
    with pytest.raises(ConfigError) as caught:
        parse_config(TrainConfig, build_parser().parse_args(["train", "--config", str(bad)]))
    message = str(caught.value)
    assert f"{bad}: batch_size: Input should be greater than 0 (got -3)" in message
    assert f"{bad}: unrol_steps: Extra inputs are not permitted" in message and "--batch-size" not in message
    # the same value given as a flag names the flag
    with pytest.raises(ConfigError, match=r"--batch-size: Input should be greater than 0 \(got -4\)"):
        parse_config(TrainConfig, build_parser().parse_args(["train", "--config", str(bad), "--batch-size", "-4"]))


def test_one_list_of_presets_and_of_tokenizers():
    assert tuple(typing.get_args(PresetName)) == tuple(PRESETS)
    assert IngestOptions.model_fields["tokenizer"].annotation is TokenizerName
    assert EmbedOptions.model_fields["tokenizer"].annotation is TokenizerName


def test_the_flows_turn_their_parameters_into_the_option_models():
    """A deployment's parameters become the options model the CLI builds from flags (coerced, checked, unknown keys
    refused), for every flow."""
    from prefect.exceptions import ParameterTypeError

    from elmo_core.options import EmbedConfig, IndexConfig, WsdConfig
    from flows.embed import embed_flow, index_flow
    from flows.pipeline import elmo_pipeline
    from flows.probe import probe_flow

    job = {"model": "m", "input": "i", "out": "o", "precision": "int8", "unit_tokens": "500"}
    assert embed_flow.validate_parameters({"config": job})["config"] == EmbedConfig.model_validate(job)
    assert index_flow.validate_parameters({"config": {"table": "t"}})["config"] == IndexConfig(table="t")
    probe = probe_flow.validate_parameters({"kind": "wsd", "wsd": {"model": "m", "out": "o"}})
    assert probe["wsd"] == WsdConfig(model="m", out="o") and probe["tag"] is None
    main_job = elmo_pipeline.validate_parameters({"params": {"train": {"n_epochs": 3}}})["params"]
    assert main_job.train == CPU_TRAIN_OPTIONS.model_copy(update={"n_epochs": 3})
    for flow, bad in [
        (embed_flow, {"config": {**job, "layer": 3}}),  # a key the model lacks
        (embed_flow, {"config": {**job, "precision": "fp16"}}),  # a value it refuses
        (index_flow, {"config": {"table": "t", "shard_rows": 0}}),
        (elmo_pipeline, {"params": {"train": {"max_vocab": 3}}}),
    ]:
        with pytest.raises(ParameterTypeError):
            flow.validate_parameters(bad)


def test_a_stage_dict_lays_over_the_main_job_defaults():
    from flows.pipeline import PipelineParams

    params = PipelineParams.model_validate({"train": {"n_epochs": 3}, "vocab": {"min_count": 5}})
    assert (params.train.preset, params.train.batch_size, params.train.n_epochs) == ("mini", 32, 3)
    assert params.vocab.min_count == 5 and params.ingest.tokenizer == "unicode"
    small = PipelineParams.model_validate({"train": {"preset": "small", "batch_size": 128}})
    assert small.train.architecture().lstm.dim == 1024 and small.train.batch_size == 128
    with pytest.raises(Exception, match="extra"):
        PipelineParams.model_validate({"train": {"max_vocab": 3}})


def test_prefect_yaml_parameters_validate_against_the_flows():
    import importlib

    project = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = set()
    for deployment in project["deployments"]:
        path, function = deployment["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, function)
        flow.validate_parameters(deployment.get("parameters") or {})  # raises on a parameter the flow lacks
        names.add(f"{flow.name}/{deployment['name']}")
    assert {"elmo/train", "elmo/train-gpu", "embed/embed", "index/index", "probe/probe"} <= names


def test_the_deprecated_bf16_flags_map_onto_precision(caplog):
    with caplog.at_level(logging.WARNING):
        assert EmbedOptions(bf16=True).precision == "bf16"
        # the same word means the same in training: bf16 (an old config does get its speed-up)
        assert TrainOptions(bf16=True).precision == "bf16" and TrainOptions(bf16=False).precision == "fp32"
    assert "'bf16' is deprecated; use precision: bf16" in caplog.text
    args = build_parser().parse_args(["embed", "--model", "m", "--input", "i", "--out", "o", "--bf16"])
    assert parse_config(COMMANDS["embed"][0], args).precision == "bf16"


def test_the_main_jobs_summary_names_commands_as_this_installation_runs_them(monkeypatch, tmp_path):
    from flows.summary import command

    bin_dir = Path(sys.executable).parent  # .venv/bin in a clone
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the venv not activated: its path, relative where inside
    monkeypatch.chdir(bin_dir.parent.parent)
    assert command("elmo") == str(Path(bin_dir.parent.name) / bin_dir.name / "elmo")
    monkeypatch.chdir(tmp_path)
    assert command("elmo") == str(bin_dir / "elmo")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # activated: the bare name
    assert command("elmo") == "elmo"
