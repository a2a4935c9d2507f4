"""`sparsetune search` on bad input and around interrupts, through the CLI in this process (trials by
the synthetic evaluator): one `error:` line and exit 2 with nothing created, no storage password in
any message or run-folder file, Ctrl-C naming the command that resumes the study, progress counting
the trials a resumed study already has, `search show` writing nothing, and the end of a run in a
log (a table row per line, then the command to run next, which runs)."""

from __future__ import annotations

import json
import shlex
import sys
import time

import pytest

from sparsetune.errors import SparsetuneError
from sparsetune.tuning import config
from sparsetune.tuning.config import SearchConfig, check_search
from sparsetune.tuning.run import run_search, show, write_json_config
from helpers import SyntheticEvaluator

PASSWORD = "s3cretPW"


@pytest.fixture
def cli(monkeypatch, capsys, tmp_path):
    """`sparsetune ARGS` in this process with synthetic trials (no engine, no tokenizer), in
    `tmp_path` (a URL taken for a relative path lands there): (exit code, stdout, stderr lines that
    are not blank)."""
    import sparsetune.tuning.config as config
    import sparsetune.tuning.trial as trial
    from sparsetune.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config, "check_prompts", lambda cfg: None)
    monkeypatch.setattr(trial, "EngineEvaluator", lambda cfg, **_: cli.evaluator(cfg))

    def cli(*args: str, evaluator=SyntheticEvaluator):
        cli.evaluator = evaluator
        monkeypatch.setattr(sys, "argv", ["sparsetune", *args])
        with pytest.raises(SystemExit) as e:
            main()
        out, err = capsys.readouterr()
        return e.value.code, out, [line for line in err.splitlines() if line.strip()]

    return cli


def _one_error(code, lines, *needles: str) -> str:
    assert code == 2, lines
    assert not any("Traceback" in line for line in lines), lines
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def _search(tmp_path, *extra: str) -> list[str]:
    return ["search", "--flow", "quest,block_topk", "--context", "2048", "--min-accuracy", "0.9",
            "--confirm-samples", "2", "--study", "s", "--out", str(tmp_path), *extra]


# ---- 1. storage URLs ------------------------------------------------------------------------------

def test_masked_url_hides_the_password_and_nothing_else():
    masked_url = config.masked_url
    assert masked_url(f"postgresql://me:{PASSWORD}@db.host:5432/search") == "postgresql://me:***@db.host:5432/search"
    assert masked_url(f"postgresql+psycopg://:{PASSWORD}@h/db") == "postgresql+psycopg://:***@h/db"
    assert masked_url(f"postgresql://me:p@ss{PASSWORD}@h/db") == "postgresql://me:***@h/db"  # an unquoted @ in it
    assert masked_url(f"postgresql://me@h/db?password={PASSWORD}&sslmode=require") == \
        "postgresql://me@h/db?password=***&sslmode=require"
    for plain in ("postgresql://me@h/db", "sqlite:///runs/s/study.db", "runs/s/study.journal"):
        assert masked_url(plain) == plain


@pytest.mark.parametrize("url", [f"mysql://user:{PASSWORD}@host/db", f"redis://user:{PASSWORD}@host:6379",
                                 f"postgres://user:{PASSWORD}@host/db"])
def test_an_unsupported_storage_is_refused_naming_the_supported_ones_without_its_password(cli, tmp_path, url):
    for args in (_search(tmp_path, "--trials", "1", "--storage", url), ["search", "worker", "--study", "s", "--storage", url],
                 ["search", "show", "--study", "s", "--storage", url]):
        code, out, lines = cli(*args)
        line = _one_error(code, lines, "postgresql://", "journal")
        assert PASSWORD not in out + "\n".join(lines) and "psycopg" not in line
        assert "user:***@" in line
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_postgresql_storage_is_one_line_without_its_password(cli, tmp_path):
    url = f"postgresql://user:{PASSWORD}@127.0.0.1:9/db"  # the discard port: nothing answers
    code, out, lines = cli(*_search(tmp_path, "--trials", "1", "--storage", url))
    _one_error(code, lines, "postgresql://user:***@127.0.0.1:9/db")
    assert PASSWORD not in out + "\n".join(lines)


def test_the_run_folder_keeps_the_storage_without_its_password_and_show_asks_for_it(tmp_path):
    cfg = SearchConfig(study="s", out=str(tmp_path), storage=f"postgresql://me:{PASSWORD}@127.0.0.1:9/db", trials=1)
    write_json_config(cfg)
    text = (tmp_path / "s" / "search.json").read_text()
    assert PASSWORD not in text and "postgresql://me:***@127.0.0.1:9/db" in text
    with pytest.raises(SparsetuneError, match=r"without its password.*--storage") as e:
        show(tmp_path / "s")
    assert PASSWORD not in str(e.value)


# ---- 2. Ctrl-C ------------------------------------------------------------------------------------

class Interrupting(SyntheticEvaluator):
    """Ctrl-C in the third trial's accuracy."""

    def accuracy(self, flow, params, **kw):
        if len(self.calls) == 2:
            self.calls.append(("interrupted", dict(params), 0, 0))
            raise KeyboardInterrupt
        return super().accuracy(flow, params, **kw)


def test_ctrl_c_says_the_study_is_kept_and_the_command_that_resumes_it(cli, tmp_path):
    code, _out, lines = cli(*_search(tmp_path, "--trials", "4", "--param", "sink_blocks=1", "--no-confirm-defaults"),
                            evaluator=Interrupting)
    assert code == 130 and not any("Traceback" in line for line in lines), lines
    said = [line for line in lines if "continue it with: " in line]
    assert len(said) == 1 and "study s is kept" in said[0], lines
    command = shlex.split(said[0].split("continue it with: ", 1)[1])
    assert command[:2] == ["sparsetune", "search"] and "--resume" in command and "--no-confirm-defaults" in command
    code, _out, lines = cli(*command[1:])  # exactly that command continues it
    assert code == 0, lines
    summary = json.loads((tmp_path / "s" / "frontier.json").read_text())
    assert summary["complete"] and summary["trials"]["finished"] == 4


# ---- 3. search show is read-only -------------------------------------------------------------------

def _files(folder) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def test_search_show_writes_nothing(cli, tmp_path):
    cfg = SearchConfig(study="s", out=str(tmp_path), trials=3, context=2048, min_accuracy=0.9, confirm_samples=2)
    run_search(cfg, SyntheticEvaluator(cfg))
    before = _files(tmp_path)
    time.sleep(0.05)  # a rewrite would show in the mtimes
    for args in (["search", "show", str(tmp_path / "s")], ["search", "show", str(tmp_path / "s"), "--json"],
                 ["search", "show", "--study", "s", "--storage", str(tmp_path / "s" / "study.journal")]):
        code, out, lines = cli(*args)
        assert code == 0, lines
    assert _files(tmp_path) == before
    # a storage that is not there is reported, not created
    code, _out, lines = cli("search", "show", "--study", "s", "--storage", str(tmp_path / "none" / "study.journal"))
    _one_error(code, lines, "no journal file")
    code, _out, lines = cli("search", "worker", "--study", "s", "--storage", str(tmp_path / "none" / "study.journal"))
    _one_error(code, lines, "no journal file")
    code, _out, lines = cli("search", "show", "--study", "s", "--storage", f"sqlite:///{tmp_path / 'none.db'}")
    _one_error(code, lines, "no database file")
    assert not (tmp_path / "none").exists() and not (tmp_path / "none.db").exists()


# ---- 4. progress after a resume --------------------------------------------------------------------

def test_progress_counts_the_trials_a_resumed_study_already_has(cli, tmp_path):
    code, _out, lines = cli(*_search(tmp_path, "--trials", "2"))
    assert code == 0 and [line for line in lines if "trials, " in line][-1].count("[2/2 trials"), lines
    code, _out, lines = cli(*_search(tmp_path, "--trials", "4", "--resume"))
    assert code == 0, lines
    counts = [line.split("[", 1)[1].split(" trials")[0] for line in lines if " trials, " in line]
    assert counts == ["3/4", "4/4"], lines


# ---- 5. fixed params are checked before a study exists -----------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_fixed_param_is_refused_before_a_study_exists(cli, tmp_path, value):
    code, _out, lines = cli(*_search(tmp_path, "--trials", "1", "--param", f"budget_ratio={value}"))
    _one_error(code, lines, "budget_ratio")
    assert not (tmp_path / "s").exists()


def test_a_param_the_flow_does_not_use_is_refused_before_a_study_exists(cli, tmp_path):
    code, _out, lines = cli("search", "--flow", "quest,streaming", "--param", "budget_ratio=0.1", "--trials", "1",
                            "--study", "s", "--out", str(tmp_path))
    _one_error(code, lines, "streaming", "budget_ratio")
    assert not (tmp_path / "s").exists()


def test_a_param_fixed_for_one_flow_holds_in_its_trials_only(tmp_path):
    """`--param quest:block_size=4` fixes quest's page at 4 (every trial, seeds included) and leaves
    block_topk's searched; a shared `--param` holds for both, and a flow's own value wins over it."""
    cfg = SearchConfig(flows=("quest", "block_topk"), params={"quest:block_size": "4", "sink_blocks": "1",
                                                              "block_topk:sink_blocks": "2"},
                       study="s", out=str(tmp_path), trials=14, context=2048, confirm_samples=2, confirm_defaults=False)
    check_search(cfg)
    evaluator = SyntheticEvaluator(cfg)
    run_search(cfg, evaluator)
    quest = [p for f, p, *_ in evaluator.calls if f == "quest"]
    topk = [p for f, p, *_ in evaluator.calls if f == "block_topk"]
    assert quest and topk
    assert {str(p["block_size"]) for p in quest} == {"4"} and {str(p["sink_blocks"]) for p in quest} == {"1"}
    assert len({str(p["block_size"]) for p in topk}) > 1 and {str(p["sink_blocks"]) for p in topk} == {"2"}


@pytest.mark.parametrize("param, needles", [
    ("tidal:budget_ratio=0.1", ("'tidal' is not one of --flow quest,streaming",)),  # not a searched flow
    ("streaming:decay=0.9", ("--param streaming:decay", "no such param")),  # its own, and it has none
    ("streaming:budget_ratio=0.1", ("streaming", "does not use --param budget_ratio")),  # one it does not use
    ("decay=0.9", ("quest has no such param", "--param FLOW:decay=VALUE")),  # shared: says how to give it to one
])
def test_a_param_for_one_flow_is_checked_before_a_study_exists(cli, tmp_path, param, needles):
    code, _out, lines = cli("search", "--flow", "quest,streaming", "--param", param, "--trials", "1",
                            "--study", "s", "--out", str(tmp_path))
    _one_error(code, lines, *needles)
    assert not (tmp_path / "s").exists()
    check_search(SearchConfig(flows=("quest", "streaming"), params={"quest:budget_ratio": "0.1"}, trials=1))  # the fix


# ---- 6. other bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_hours_are_refused(cli, tmp_path, value):
    code, _out, lines = cli(*_search(tmp_path, "--trials", "1", "--hours", value))
    _one_error(code, lines, "--hours")
    assert not (tmp_path / "s").exists()


def test_a_non_finite_agent_budget_is_refused():  # nan would never be spent: the proposer's calls would not stop
    with pytest.raises(SparsetuneError, match="--agent-budget-usd"):
        SearchConfig(agent="evolve", agent_budget_usd=float("nan"))


def test_search_show_of_a_damaged_search_json_is_one_line(cli, tmp_path):
    (tmp_path / "s").mkdir()
    for text in ("{not json", json.dumps({"schema": "x"}), json.dumps({"search": {"context": "many"}})):
        (tmp_path / "s" / "search.json").write_text(text)
        code, _out, lines = cli("search", "show", str(tmp_path / "s"))
        _one_error(code, lines, "search.json")


# ---- 7. the end of a run, in a log or a pipe -----------------------------------------------------------

def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("│")]


def test_in_a_pipe_the_table_keeps_a_row_per_line_and_the_run_ends_with_the_export_command_that_works(cli, tmp_path):
    """Not a terminal (a log, `| tee`): no cell wraps into the next line; the last line is the export
    of the fastest confirmed point above the bar, and exactly that command exports it."""
    from sparsetune.cli.search import _short

    code, out, lines = cli(*_search(tmp_path, "--trials", "4"))
    assert code == 0, lines
    summary = json.loads((tmp_path / "s" / "frontier.json").read_text())
    rows = _table_rows(out)
    assert rows and all(not row.startswith("│   ") for row in rows), out  # a wrapped row goes on with an empty label
    for r in summary["defaults"] + summary["confirmed_frontier"]:
        assert any(r["trial"] in row and _short(r["params"]) in row for row in rows), (r, out)
    said, command = out.rstrip("\n").splitlines()[-2:]
    point = max(summary["confirmed_frontier"], key=lambda r: r["speedup"])
    assert said.startswith(f"next: export {point['trial']} ") and "--min-accuracy 0.9" in said, said
    args = shlex.split(command)
    assert args[:3] == ["sparsetune", "export", str(tmp_path / "s")] and command.strip() == summary["next_command"]
    code, _out, lines = cli(*args[1:])
    assert code == 0, lines
    assert json.loads((tmp_path / "bundles" / "s" / "bundle.json").read_text())["origin"]["trial"] == point["trial"]
    code, shown, lines = cli("search", "show", str(tmp_path / "s"))  # show ends the same way
    assert code == 0 and shown.rstrip("\n").splitlines()[-2:] == [said, command], lines


def test_with_json_the_next_command_is_a_field_and_stdout_is_only_the_json(cli, tmp_path):
    code, out, lines = cli(*_search(tmp_path, "--trials", "4", "--json"))
    assert code == 0, lines
    result = json.loads(out)  # nothing else on stdout
    assert result["next_command"].startswith(f"sparsetune export {tmp_path / 's'} --pick ")
    assert lines[-1].strip() == result["next_command"] and lines[-2] == f"next: {result['next_step']}:"
    assert all(not row.startswith("│   ") for row in _table_rows("\n".join(lines)))  # the table, on stderr: no wraps


def test_a_search_with_no_confirmed_point_above_its_bar_ends_with_the_command_that_runs_more_trials(cli, tmp_path):
    args = [a if a != "0.9" else "0.99" for a in _search(tmp_path, "--trials", "2")]
    code, out, lines = cli(*args)
    assert code == 0, lines
    said, command = out.rstrip("\n").splitlines()[-2:]
    assert said.startswith("next: no confirmed point at --min-accuracy 0.99") and "lower --min-accuracy" in said
    args = shlex.split(command)
    assert args[:2] == ["sparsetune", "search"] and "--resume" in args and args[args.index("--trials") + 1] == "4"
    code, _out, lines = cli(*args[1:])  # it continues the study with as many trials again
    assert code == 0, lines
    assert json.loads((tmp_path / "s" / "frontier.json").read_text())["trials"]["finished"] == 4


def test_a_reuse_search_ends_with_the_eval_command_that_runs_its_point(cli, tmp_path, monkeypatch):
    """The next step measures the point with `sparsetune eval`, whose flags give the evaluation the
    trial's reuse flow, params, tasks and context (and says how to export it for SGLang)."""
    import sparsetune.evaluation.runner as runner
    from sparsetune.tuning.report import next_step

    cfg = SearchConfig(kind="reuse", study="r", out=str(tmp_path), flows=("cacheblend",), context=512, min_accuracy=0.9)
    point = {"trial": "cacheblend#3", "flow": "cacheblend", "params": {"ratio": "0.07", "check_layer": "2"},
             "confirmed_accuracy": 0.93, "speedup": 2.5, "speed_kind": "modeled"}
    said, command = next_step(cfg, {"confirmed_frontier": [point], "trials": {"finished": 6, "failed": 0}})
    assert said.startswith("measure cacheblend#3 ") and "writes a reuse bundle SGLang serves" in said
    assert f"sparsetune export {cfg.run_dir} --pick" in said
    seen = {}

    def evaluate(ecfg, **_kw):
        seen["cfg"] = ecfg
        raise SparsetuneError("stopped here")

    monkeypatch.setattr(runner, "evaluate", evaluate)
    args = shlex.split(command)
    assert args[:2] == ["sparsetune", "eval"]
    code, _out, lines = cli(*args[1:])
    assert code == 2 and lines[-1] == "error: stopped here", lines
    ecfg = seen["cfg"]
    reuse = ecfg.setup.reuse
    assert (reuse.name, reuse.user_params(), ecfg.setup.defaults) == ("cacheblend", {"ratio": 0.07, "check_layer": 2}, "published")
    assert (tuple(ecfg.tasks), ecfg.context, ecfg.samples) == (cfg.tasks, 512, cfg.confirm_samples)


def test_a_modeled_speed_shape_defaults_to_the_costs_shape_and_is_pinned_in_the_fingerprint(tmp_path):
    """A modeled decode speed with no --speed-* options is taken where the GPU costs were measured and
    tested (Qwen3-8B, 16 x 32K); anything else keeps the search's own shape or the options given."""
    base = dict(model="smollm2-135m", context=1024, batch=8, out=str(tmp_path), device="cpu")
    assert SearchConfig(flows=("quest", "block_topk"), **base).speed_shape() == ("qwen3-8b", True, 16, 32768)
    assert SearchConfig(flows=("quest",), speed_context=4096, **base).speed_shape() == ("smollm2-135m", False, 8, 4096)
    assert SearchConfig(flows=("quest",), speed_model="qwen3-1.7b", **base).speed_shape() == ("qwen3-1.7b", True, 8, 1024)
    assert SearchConfig(flows=("quest", "streaming"), **base).speed_shape() == ("smollm2-135m", False, 8, 1024)  # a fixed window
    assert SearchConfig(flows=("quest",), params={"budget": "128"}, **base).speed_shape() == ("smollm2-135m", False, 8, 1024)
    assert SearchConfig(flows=("quest", "block_topk"), params={"quest:budget": "128"}, **base).speed_shape()[0] == "smollm2-135m"
    assert SearchConfig(flows=("quest",), speed="measured", **base).speed_shape() == ("smollm2-135m", False, 8, 1024)
    reuse = SearchConfig(kind="reuse", flows=("cacheblend",), **base)
    assert reuse.speed_shape() == ("smollm2-135m", False, 8, 1024) and reuse.pinned() is reuse
    # the study stores the shape it resolved: a run that would resolve another one is told apart
    pinned = SearchConfig(flows=("quest",), **base).pinned()
    assert (pinned.speed_model, pinned.speed_batch, pinned.speed_context) == ("qwen3-8b", 16, 32768)
    assert pinned.fingerprint() != SearchConfig(flows=("quest",), **base).fingerprint()
    assert pinned.pinned() == pinned and pinned.speed_shape() == ("qwen3-8b", True, 16, 32768)


def test_a_proposed_fixed_window_flow_is_refused_where_speed_is_taken_at_another_context(tmp_path):
    from sparsetune.loader import flow_path, load_file

    cfg = SearchConfig(flows=("quest",), model="smollm2-135m", context=1024, out=str(tmp_path), device="cpu").pinned()
    with pytest.raises(SparsetuneError, match="fixed window of tokens.*--speed-context 1024"):
        config.check_speed_context(cfg, "streaming", load_file(flow_path("streaming")))
    config.check_speed_context(cfg, "block_topk", load_file(flow_path("block_topk")))  # a share of the context
