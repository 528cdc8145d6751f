"""The ``elmo`` console script, run as a user runs it (a real subprocess)."""

from tests.helpers import run_elmo


def test_demo_embeds_the_probes_with_the_fixture_model():
    result = run_elmo("demo")
    assert result.returncode == 0, result.stderr
    assert "embedded     10 sentences, 91 tokens" in result.stdout
    assert "s8:苹果" in result.stdout


def test_info_and_a_clear_error_for_a_missing_model(tmp_path, allennlp_dir):
    ok = run_elmo("info", str(allennlp_dir))
    assert ok.returncode == 0 and "2x64_16, 124 filters" in ok.stdout
    bad = run_elmo("info", str(tmp_path))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == f"elmo info: error: {tmp_path}/options.json: options file not found"
