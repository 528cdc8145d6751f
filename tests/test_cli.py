"""The ``elmo`` console script, run as a user runs it (a real subprocess)."""

import pytest

from tests.helpers import run_elmo


def test_demo_embeds_the_probes_without_a_model_given():
    result = run_elmo("demo")
    assert result.returncode == 0, result.stderr
    assert "embedded     10 sentences, 91 tokens" in result.stdout
    assert "s8:苹果" in result.stdout


@pytest.mark.slow
def test_info_and_a_clear_error_for_a_missing_model(tmp_path, allennlp_dir):
    ok = run_elmo("info", str(allennlp_dir))
    assert ok.returncode == 0 and "2x64_16, 124 filters" in ok.stdout
    bad = run_elmo("info", str(tmp_path))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(f"elmo info: error: {tmp_path}: no options.json; a model is")


def test_help_and_a_bad_flag_answer_without_loading_torch():
    """``elmo --help``, a stage's help and a bad flag need only the options: torch (seconds to import on a busy
    machine) is not loaded for them."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from elmo_core.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    for args, code in ((["--help"], 0), (["embed", "--help"], 0), (["train", "--bogus", "1"], 2)):
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
        assert done.stderr.strip().splitlines()[-1] == f"exit {code} False", (args, done.stderr)
    assert (
        "embed"
        in subprocess.run(
            [sys.executable, "-m", "elmo_core.cli", "--help"], capture_output=True, text=True, timeout=120
        ).stdout
    )


def test_every_command_prints_its_help():
    """``elmo COMMAND --help`` for every command: argparse reads a help text as a %-format, so a description with a
    percent sign (``0.02: 2% lower``) once made ``elmo train --help`` and ``elmo promote --help`` raise instead."""
    import contextlib
    import io

    from elmo_core.cli import build_parser
    from tests.test_options import _subparsers

    parser = build_parser()
    commands = _subparsers(parser)
    assert {"train", "promote", "embed", "serve", "probe"} <= set(commands)
    asked = [[name] for name in commands] + [["probe", name] for name in _subparsers(commands["probe"])]
    for words in asked:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as ended:
            parser.parse_args([*words, "--help"])
        assert ended.value.code == 0 and f"elmo {' '.join(words)}" in printed.getvalue(), words
    assert "2% lower" in commands["train"].format_help()
