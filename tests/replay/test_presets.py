"""--preset agentx: AgentX v1.0's methodology where the user left a flag at its default."""

from __future__ import annotations

from agentload.replay.cli import with_preset
from agentload.replay.engine.presets import AGENTX, headline_line
from tests.support import run_cli


def test_agentx_fills_in_what_was_left_at_its_default() -> None:
    assert with_preset("agentx", False, None, None, "pinned") == (True, 3600.0, 300.0, "pool")
    # Flags given explicitly win over the preset.
    assert with_preset("agentx", False, 60.0, 5.0, "pinned") == (True, 60.0, 5.0, "pool")
    assert with_preset(None, False, None, None, "pinned") == (False, None, None, "pinned")


def test_the_headline_is_e2e_normalized_p90() -> None:
    line = headline_line({"e2e_norm_p90_interactivity_tok_s": 41.234}, AGENTX)
    assert line == "agentx headline, E2E-normalized P90 interactivity: 41.2 tok/s/user"
    assert headline_line({}, AGENTX).endswith(": n/a")


def test_an_unknown_preset_is_one_line_and_exit_2() -> None:
    done = run_cli("replay", "tests/data/weka", "--target", "http://127.0.0.1:9",
                   "--preset", "mlperf")
    assert done.returncode == 2
    assert done.stderr.strip() == "agentload: error: --preset must be one of agentx; got 'mlperf'"
