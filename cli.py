"""``capture``: the command line (click). Thin: every command calls one library function.

User errors (:class:`common.errors.CaptureError`) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys

import click

from common.errors import CaptureError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CaptureError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


class _RunDir(click.ParamType):
    """A run: a local folder or a URI (``s3://``, ``gs://``, ``objstore+file://``, ...), resolved by
    :func:`shards.run.as_location`; an unknown scheme is a one-line error, and so (``must_exist``) is a
    local path that is no folder."""

    name = "run_dir"

    def __init__(self, must_exist: bool):
        self.must_exist = must_exist

    def convert(self, value, param, ctx):
        from shards.run import as_location

        try:
            loc = as_location(str(value))
        except CaptureError as e:
            self.fail(str(e), param, ctx)
        if self.must_exist and not loc.is_folder():
            self.fail(f"{value} is not a folder", param, ctx)
        return str(value)


RUN_DIR = _RunDir(must_exist=True)
RUN = _RunDir(must_exist=False)  # the command itself says what is missing


class _Registry(click.Choice):
    """A ``click.Choice`` over a list declared elsewhere (a registry's names, a setting's values), read when
    first needed, so that ``capture --help`` does not import torch. ``check=False``: the list is shown
    (``[a|b]``) but any value passes, for ``RunConfig`` to refuse in its own words."""

    def __init__(self, names, check: bool = True):
        self._names = names
        self._check = check
        super().__init__(())

    @property
    def choices(self):
        return tuple(self._names())

    @choices.setter
    def choices(self, _):
        pass

    def convert(self, value, param, ctx):
        return super().convert(value, param, ctx) if self._check else value


def _codec_names():
    from shards.codecs import CODECS

    return CODECS


def _engine_names():
    from capture.engines import NAMES

    return NAMES


def _run_choice(name: str, check: bool = True) -> _Registry:
    """The values of the run setting ``name``, from its one declaration (:func:`capture.config.choices`)."""
    def names():
        from capture.config import choices

        return choices()[name]

    return _Registry(names, check)


CODEC = _Registry(_codec_names)
ENGINE = _Registry(_engine_names)


def _engine_options(command):
    """Add each engine option's flag to ``command`` from its one declaration in
    :data:`capture.engines.REGISTRY` (flag, field, type, choices, help, repeatable): an engine option is
    declared there and nowhere else. Reads the declarations only (no engine, no torch)."""
    from capture.engines import options

    for opt in reversed(options()):
        kind = click.Choice(opt.choices) if opt.choices else opt.type
        command = click.option(opt.flag, opt.name, type=kind, multiple=opt.multiple, help=opt.help,
                               metavar="KEY=VALUE" if opt.multiple else None)(command)
    return command


def _emit(data, as_json: bool, render) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
    else:
        render(data)


def _table(rows: list[dict]) -> None:
    if not rows:
        click.echo("(none)")
        return
    keys = list(rows[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    click.echo("  ".join(k.ljust(w) for k, w in zip(keys, widths)).rstrip())
    for c in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())


@click.group(cls=_Group)
@click.option("-v", "--verbose", count=True, help="-v: debug (each skipped row and its reason).")
def main(verbose: int) -> None:
    """Capture target hidden states over conversation datasets into verified shards."""
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "fsspec", "transformers"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def targets(as_json: bool) -> None:
    """Target presets: layers, hidden size, default taps, final state, engine."""
    import dataclasses

    from capture.targets import PRESETS

    rows = [dataclasses.asdict(t) for t in PRESETS.values()]
    _emit(rows, as_json, lambda rs: _table([
        {"name": r["name"], "arch": r["architecture"], "layers": r["num_layers"], "hidden": r["hidden_size"],
         "taps": ",".join(map(str, r["default_taps"])), "final": r["default_final"], "chat": r["chat_template"],
         "weights": r["quantization"], "engine": r["engine"] + (f" tp{r['tp']}" if r["tp"] > 1 else ""),
         "source": r["source"]} for r in rs]))


@main.command()
@click.option("--config", "config_file", type=click.Path(), help="YAML file of run settings; flags override it.")
@click.option("--out", help="Run folder (shards + manifest.jsonl), or a URI such as s3://bucket/run (README: "
              "Object stores). Rerun the same command to resume.")
@click.option("--target", help="Preset (see `capture targets`) or a local model folder.")
@click.option("--model-path", type=click.Path(), help="Local weights for a preset target (default: HF cache).")
@click.option("--dataset", help="`sharegpt`, a local .json/.jsonl/.parquet/.arrow file, or a hub id.")
@click.option("--split", help="Dataset split (default train).")
@click.option("--layers", help="Comma-separated taps: output of decoder layer k, 0-based.")
@click.option("--final", type=_run_choice("final"), help="Also store the final state.")
@click.option("--argmax/--no-argmax", default=None, help="Store the target's greedy next token (default on).")
@click.option("--topk", type=int, metavar="K", help="Store the target's K largest next-token log-probabilities per "
              "token (topk_ids, topk_logprobs; 1..1024, 0: none; hf and vllm engines).")
@click.option("--no-topk", is_flag=True, default=None, help="Store no top-K (the default; overrides a config file).")
@click.option("--limit", type=int, help="Read at most N dataset rows (counted before any filter).")
@click.option("--skip", type=int, help="Pass over the first N dataset rows (sample ids keep their row index).")
@click.option("--sources", help="Keep only these comma-separated sources.")
@click.option("--exclude-sources", help="Drop these comma-separated sources.")
@click.option("--source-cap", "source_caps", multiple=True, help="SOURCE=N: at most N rows of SOURCE (repeatable).")
@click.option("--alternation", type=_run_choice("alternation"), help="Rows breaking user/assistant alternation.")
@click.option("--chat-template", type=click.Path(), help="Jinja chat template file overriding the tokenizer's.")
@click.option("--system-prompt", help="System turn added to conversations that have none.")
@click.option("--special-text", type=_run_choice("special_text"), help="Row text that spells a special token (a typed <|im_end|>): text (default) "
              "tokenizes it as plain text, drop skips the row, keep makes it the control token.")
@click.option("--chat-template-kwarg", "chat_template_kwargs", multiple=True,
              help="KEY=VALUE template variable, e.g. enable_thinking=false (JSON value, else a string; repeatable).")
@click.option("--responses", type=_run_choice("responses", check=False),
              help="Answers from the dataset (default) or regenerated by the target (self-distillation).")
@click.option("--regenerate-policy", type=_run_choice("regenerate_policy", check=False),
              help="regenerate: only the last assistant turn (default) or every turn in order.")
@click.option("--temperature", type=float, help="regenerate: sampling temperature (default 0 = greedy).")
@click.option("--top-p", type=float, help="regenerate: nucleus sampling (default 1.0).")
@click.option("--max-new-tokens", type=int, help="regenerate: new tokens per answer at most (default 512).")
@click.option("--seed", type=int, help="regenerate: sampling seed (default 0).")
@click.option("--min-tokens", type=int)
@click.option("--max-tokens", type=int)
@click.option("--min-loss-tokens", type=int)
@click.option("--overlength", type=_run_choice("overlength"), help="Over --max-tokens / model context.")
@click.option("--dedup/--no-dedup", default=None, help="Drop exact duplicates by token_sha256.")
@click.option("--codec", type=CODEC,
              help="State codec (default bf16-split, lossless; fp8-e4m3 is lossy, 0.43x).")
@click.option("--codec-threads", type=int, help="Encoder threads per replica (default 2).")
@click.option("--shard-size", help="Target shard size, e.g. 512MiB.")
@click.option("--batch-tokens", type=int, help="Tokens per engine call (default 8192): the hf engine still prefills one "
              "record per forward; with --responses regenerate, padded tokens per generation batch.")
@click.option("--unit-tokens", type=int, help="Tokens per work unit sent to a replica.")
@click.option("--commit-every", type=float,
              help="Seconds an open shard may stay open before it closes and commits with its unit (default "
                   "300); each replica's first unit (--first-unit-tokens, default 4096) commits its first shard.")
@click.option("--first-unit-tokens", type=int, help="Tokens in each replica's first work unit (default 4096).")
@click.option("--replicas", type=int)
@click.option("--cpus-per-replica", type=int)
@click.option("--ray-address", help="Ray cluster address: auto, ray://host:10001, host:6379 (default: start a local instance).")
@click.option("--executor", type=_run_choice("executor"),
              help="Where replicas run: ray (actors, each its own process; a dead or hung replica replaced, --unit-timeout, clusters), "
                   "local (one replica in this process: no Ray daemons), or auto (default: local for one hf "
                   "replica without --ray-address or --unit-timeout, else ray).")
@click.option("--unit-timeout", type=float, help="Seconds a work unit may run before its replica counts as hung "
              "and is replaced (default: no limit).")
@click.option("--max-unit-attempts", type=int, help="Failures of a work unit before it is split; a single record "
              "that fails this often is quarantined (default 3).")
@click.option("--engine", type=ENGINE,
              help="hf (transformers), vllm, exl3 (exllamav3, CUDA only, prefill only), or auto (default: the "
                   "engine an engine-specific option names, else vllm when installed and a GPU is visible, else hf; "
                   "a resume keeps the run's engine; the summary says which ran and why).")
@_engine_options  # --dtype, --device, --gpus-per-replica, --vllm-path, --tp, ...: declared by the engines
@click.option("--self-check", type=int, help="Stored rows rechecked at the end against an independent float32 HF "
              "forward on this machine (`capture shards check`), recorded in the completion record and provenance.json; "
              "exit 1 when they fail (default 8 for vllm; 0 = off for hf and exl3, whose EXL3 weights transformers "
              "cannot load).")
@click.option("--disk-reserve", help="Free space to keep on the output disk, e.g. 1GiB (default 64MiB).")
@click.option("--retain", type=int, help="Tail mode with bounded disk: keep at most N committed shards; shards every "
              "reader rank acked (ShardStream.ack) are removed, and the run waits for acks when N are on disk "
              "(default: keep every shard).")
@click.option("--dry-run", is_flag=True, default=None, help="Print the plan (records, tokens, bytes); write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def run(config_file, as_json, no_progress, **flags) -> None:
    """Capture hidden states (resumes an existing run folder)."""
    from capture.config import from_mapping, load_yaml
    from capture.driver import run as run_capture

    values = load_yaml(config_file) if config_file else {}
    flags = {k: v for k, v in flags.items() if v != ()}  # a repeatable flag not given
    if flags.pop("no_topk"):
        if flags["topk"] is not None:
            raise CaptureError("--topk and --no-topk contradict each other; give one")
        flags["topk"] = 0
    values.update({k: v for k, v in flags.items() if v is not None})
    if no_progress:
        values["progress"] = False
    cfg = from_mapping(values)
    # Ray forwards its workers' and raylet's messages to stdout; keep stdout for the summary alone
    with contextlib.redirect_stdout(sys.stderr):
        summary = run_capture(cfg).as_dict()
    _emit(summary, as_json, _print_summary)
    if summary["self_check"] and not summary["self_check"]["ok"]:
        click.echo("self-check FAILED (the rows stay committed; `capture shards check` for details): "
                   + "; ".join(summary["self_check"]["problems"]), err=True)
        sys.exit(1)


def _print_summary(s: dict) -> None:
    if s["estimated_tokens"] is not None:
        click.echo(f"plan for {s['out']}: {s['kept']} records, {s['estimated_tokens']:,} tokens, "
                   f"~{s['estimated_bytes'] / 2**20:,.1f} MiB"
                   + (f"; {s['free_bytes'] / 2**30:,.1f} GiB free there" if s["free_bytes"] is not None else ""))
        click.echo("estimated size by codec: " + ", ".join(
            f"{c} {b / 2**20:,.1f} MiB" for c, b in s["estimated_bytes_by_codec"].items()))
    else:
        click.echo(f"{s['out']}: committed {s['committed_rows']} rows, {s['committed_tokens']:,} tokens, "
                   f"{s['shards']} shard(s), {s['committed_bytes'] / 2**20:,.1f} MiB in {s['seconds']} s; "
                   f"run total {s['total_rows']} rows, {s['total_tokens']:,} tokens")
    click.echo(f"rows read {s['rows_read']}, already committed {s['already_committed']}, kept {s['kept']}")
    if s["retained"]:
        r = s["retained"]
        click.echo(f"retain {r['limit']}: removed {r['removed_shards']} consumed shard(s) ({r['removed_rows']} rows), "
                   f"at most {r['peak_live']} committed shard(s) on disk, {r['wait_seconds']:.1f} s waiting for readers")
    if s["engine"]:
        click.echo(f"engine: {s['engine']}")
    if s["timings"]:
        t = s["timings"]
        click.echo(f"time: prepare {t['prepare']:.1f} s, start ({'Ray, ' if s['executor'] == 'ray' else ''}engine load, "
                   f"replicas {s['executor'] or 'none'}) {t['start']:.1f} s, "
                   f"engine {t['engine']:.1f} s, encode+write {t['write']:.1f} s (beside the engine), "
                   f"commit {t['commit']:.1f} s")
    for title in ("skipped", "rejected", "normalized"):
        if s[title]:
            click.echo(f"{title}: " + ", ".join(f"{k}={v}" for k, v in sorted(s[title].items())))
    if s["truncated_input"]:
        click.echo(f"input: {s['truncated_input']}")
    if len(s["replicas"]) > 1 or any(r["restarts"] or r["dropped"] for r in s["replicas"]):
        _table([{"replica": r["replica"], "units": r["units"], "rows": r["rows"], "tokens": r["tokens"],
                 "busy s": round(r["busy_seconds"], 1), "restarts": r["restarts"], "units redone": r["units_redone"],
                 "failures": "; ".join(f"{k} x{v}" for k, v in r["failures"].items())
                 + (f"; dropped: {r['dropped']}" if r["dropped"] else "")} for r in s["replicas"]])
    lost = sorted({n for r in s["replicas"] for n in r["lost_nodes"]})
    if lost:
        click.echo(f"lost node(s): {', '.join(lost)}; replicas {[r['replica'] for r in s['replicas'] if r['lost_nodes']]} "
                   f"were on them, {sum(r['units_redone'] for r in s['replicas'])} unit(s) redone")
    if s["self_check"]:
        c = s["self_check"]
        click.echo(f"self-check of {c['rows']} rows against a {c['dtype']} HF forward: {'OK' if c['ok'] else 'FAILED'}; "
                   "per-token cosine mean " + ", ".join(f"{k} {v['cos_mean']:.5f}" for k, v in c["taps"].items())
                   + (f"; argmax agreement {c['argmax_agreement']:.4f}" if c["argmax_agreement"] is not None else ""))
    if s["quarantined"]:
        click.echo(f"quarantined {len(s['quarantined'])} record(s) (not written; a rerun retries them): "
                   + "; ".join(f"{k}: {v}" for k, v in sorted(s["quarantined"].items())[:10]))


@main.group()
def shards() -> None:
    """Inspect and check a run folder."""


@shards.command("ls")
@click.argument("run_dir", type=RUN_DIR)
@click.option("--json", "as_json", is_flag=True)
def shards_ls(run_dir, as_json) -> None:
    """Committed shards, in commit order."""
    from shards.summary import ls

    rows = ls(run_dir)
    _emit(rows, as_json, lambda rs: _table([{**r, "sha256": r["sha256"][:16]} for r in rs]))


@shards.command("stat")
@click.argument("run_dir", type=RUN_DIR)
@click.option("--json", "as_json", is_flag=True)
def shards_stat(run_dir, as_json) -> None:
    """Totals, bytes per token, per-source table."""
    from shards.summary import stat

    def render(s):
        for k, v in s.items():
            if k == "last_completion" and v:  # one line per field, not one long dict
                click.echo(f"{k:28s} {v.get('end_time')}")
                for field in ("rows_read", "committed_rows", "already_committed", "total_rows", "total_tokens",
                              "skipped", "rejected", "quarantined", "retained", "online"):
                    if v.get(field) not in (None, {}, []):
                        click.echo(f"  {field:26s} {v[field]}")
            elif k != "sources":
                click.echo(f"{k:28s} {v}")
        _table([{"source": k, **v} for k, v in s.get("sources", {}).items()])

    _emit(stat(run_dir), as_json, render)


@shards.command("head")
@click.argument("run_dir", type=RUN_DIR)
@click.option("-n", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def shards_head(run_dir, n, as_json) -> None:
    """The first rows: ids, lengths, state norms."""
    from shards.summary import head

    _emit(head(run_dir, n), as_json, lambda rows: [click.echo(json.dumps(r)) for r in rows])


@shards.command("verify")
@click.argument("run_dir", type=RUN_DIR)
@click.option("--json", "as_json", is_flag=True)
def shards_verify(run_dir, as_json) -> None:
    """Recompute sha256, check schema, rows and tokens against the manifest. Exit 1 on any problem."""
    import dataclasses

    from shards.verify import verify

    report = verify(run_dir)

    def render(r):
        for p in r["problems"]:
            click.echo(f"FAIL {p}")
        if r["garbage"]:
            click.echo(f"note: {len(r['garbage'])} uncommitted file(s) (not part of the run; `capture shards gc`)")
        if r["removed_shards"]:
            click.echo(f"note: {r['removed_shards']} shard(s), {r['removed_rows']} rows removed after every reader "
                       "consumed them (--retain): not checked")
        if r["lost_shards"]:
            click.echo(f"note: {r['lost_shards']} shard(s), {r['lost_rows']} rows given up by `capture shards repair`: "
                       "not committed (a rerun of the capture captures them again)")
        if not r["rows"] and not r["removed_rows"] and not r["problems"]:
            click.echo("note: the run holds no rows (its completion record says why: `capture shards stat`)")
        state = ("complete" if r["complete"] else "incomplete (no completion record yet)") if r["readable"] else \
            "state unknown (its manifest cannot be read)"
        verdict = "OK" if not r["problems"] else f"{len(r['problems'])} problem(s)"
        click.echo(f"{verdict}: {r['shards']} shards, {r['rows']} rows, {r['tokens']:,} tokens; run {state}")

    _emit(dataclasses.asdict(report), as_json, render)
    sys.exit(0 if report.ok else 1)


@shards.command("check")
@click.argument("run_dir", type=RUN_DIR)
@click.option("--rows", type=click.IntRange(1), default=8, show_default=True, help="Stored rows to recompute.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="The reference forward's arithmetic.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which rows (spread over lengths).")
@click.option("--model-path", help="The target folder (default: model_dir in the run's provenance.json).")
@click.option("--json", "as_json", is_flag=True)
def shards_check(run_dir, rows, dtype, seed, model_path, as_json) -> None:
    """Recompute stored rows with an independent HF forward and compare every tap, the final state and
    argmax. Exit 1 below the thresholds (provenance/check.py)."""
    from provenance.check import check, markdown

    report = check(run_dir, rows=rows, dtype=dtype, seed=seed, model_path=model_path)
    _emit(report.as_dict(), as_json, lambda r: click.echo(markdown(report)))
    sys.exit(0 if report.ok else 1)


@shards.command("recode")
@click.argument("src", type=RUN_DIR)
@click.argument("dst")
@click.option("--codec", required=True, type=CODEC)
@click.option("--shard-size", default="512MiB", show_default=True)
@click.option("--threads", default=2, show_default=True, help="Encoder threads.")
def shards_recode(src, dst, codec, shard_size, threads) -> None:
    """Copy a run into DST with its states stored in another codec (rerun to resume)."""
    from capture.config import parse_size
    from shards.recode import recode

    c = recode(src, dst, codec, shard_size=parse_size(shard_size), threads=threads)
    click.echo(f"{dst}: recoded {c['rows']} rows into {c['shards']} shard(s), {c['bytes'] / 2**20:,.1f} MiB "
               f"({c['already']} already there)")


@shards.command("repair")
@click.argument("run_dir", type=RUN_DIR)
@click.option("--dry-run", is_flag=True, help="List the damaged or missing shards; change nothing.")
def shards_repair(run_dir, dry_run) -> None:
    """Give up committed shards that are damaged or missing (as verify finds them): a `lost` manifest line
    records them and why, their files are deleted, and rerunning the same `capture run` captures exactly
    their rows again. Refused while a capture writes to RUN_DIR."""
    from shards.repair import repair

    r = repair(run_dir, dry_run)
    for name, why in r.lost.items():
        click.echo(f"{'damaged' if dry_run else 'given up'}: {name}: {why}")
    if not r.lost:
        click.echo(f"nothing to repair: all {r.checked} committed shard(s) verify")
    elif dry_run:
        click.echo(f"{len(r.lost)} of {r.checked} shard(s), {r.rows} row(s) would be given up (--dry-run: nothing changed)")
    else:
        click.echo(f"{len(r.lost)} of {r.checked} shard(s) given up; rerun the same `capture run` to capture "
                   f"their {r.rows} row(s) again")


@shards.command("gc")
@click.argument("run_dir", type=RUN_DIR)
@click.option("--dry-run", is_flag=True, help="List what would be removed.")
def shards_gc(run_dir, dry_run) -> None:
    """Remove shard files no manifest line names (left by interrupted runs). Refused while a capture
    writes to RUN_DIR, and in a folder that holds no run."""
    from shards.manifest import gc

    removed = gc(run_dir, dry_run)
    for name in removed:
        click.echo(f"{'would remove' if dry_run else 'removed'} {name}")
    if not removed:
        click.echo("nothing to remove")


@main.command("export")
@click.argument("run_dir", type=RUN)
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--format", "fmt", required=True, type=click.Choice(["specforge", "speculators"]),
              help="specforge: rows_*/data_{i}.ckpt (torch.save); speculators: hidden_states/hs_{i}.safetensors + HF dataset.")
@click.option("--split", default="all", show_default=True, type=click.Choice(["all", "train", "heldout"]),
              help="Rows by sample_id hash (shards.stream.in_split).")
@click.option("--heldout-fraction", default=0.01, show_default=True, type=float)
@click.option("--layers", help="Taps to export as aux states, in order, e.g. 3,15,27 (default: all; "
              "SpecForge's EAGLE-3 takes exactly 3).")
@click.option("--no-states", is_flag=True, help="speculators: the index alone (dataset + export.json, no state "
              "files); its trainer reads the states from the run in place (`torchrun -m shards.speculators "
              "... --hidden-states-backend capture`, docs/reading.md).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def export_cmd(run_dir, out, fmt, split, heldout_fraction, layers, no_states, no_progress) -> None:
    """Write RUN_DIR's samples as another trainer's per-sample files into OUT (a new folder).

    speculators gets the pre-norm final state in its last slot (it applies the final norm itself; from a
    --final pre-norm run or a tap at layer L-1), specforge the post-norm one. OUT/export.json records the
    layer ids each trainer wants (e.g. speculators' --target-layer-ids)."""
    from capture.targets import parse_layers
    from shards.export import export

    r = export(run_dir, out, fmt, split=split, heldout_fraction=heldout_fraction, layers=parse_layers(layers),
               progress=not no_progress, states=not no_states)
    for w in r["warnings"]:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"{r['out']}: {r['samples']} samples, {r['tokens']:,} tokens as {r['format']} files")
    for name, t in r["trainers"].items():
        ids = t.get("args") or f"eagle_aux_hidden_state_layer_ids={t['eagle_aux_hidden_state_layer_ids']}"
        click.echo(f"{name}: {ids} (see {r['out']}/export.json)")


@main.group("drafter")
def drafter_group() -> None:
    """Train a small block drafter on a capture run and score it offline."""


def _drafter_values(config_file, flags: dict) -> dict:
    from capture.config import load_yaml

    values = load_yaml(config_file) if config_file else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    return values


@drafter_group.command("train")
@click.option("--config", "config_file", type=click.Path(), help="YAML file of TrainConfig keys; flags override it.")
@click.option("--run", help="Capture run folder (shards + manifest.jsonl).")
@click.option("--online", type=click.Path(), help="A `capture run --config` YAML: capture it now and train on its "
              "rows straight from the Ray replicas, with no shards on disk (--run defaults to its out folder).")
@click.option("--follow", is_flag=True, default=None, help="--run is a capture still writing its shards: train on "
              "its rows as they are committed (tail mode; needs --heldout-run).")
@click.option("--out", help="Output folder: model.safetensors, config.json, metrics.jsonl.")
@click.option("--target-dir", type=click.Path(), help="Model folder with the target's safetensors "
              "(default: the run's provenance.json model_dir).")
@click.option("--heldout-run", help="Score on every row of this run (e.g. the target's own answers to held-out "
              "prompts) instead of a --heldout-fraction split; train rows sharing a prompt with it are dropped.")
@click.option("--seed", type=int)
@click.option("--block-size", type=int, help="Block of B: the anchor token and B-1 drafted tokens (default 8).")
@click.option("--window", type=int, help="Context positions before the anchor a block attends to (default 2048).")
@click.option("--d-model", type=int)
@click.option("--n-layers", type=int)
@click.option("--n-heads", type=int)
@click.option("--dropout", type=float, help="Dropout on the context features and residual branches (default 0).")
@click.option("--lookup", type=int, help="Give drafted slots the prompt-lookup draft of an n-gram match of this "
              "length (default 2; 0: off).")
@click.option("--steps", type=int)
@click.option("--anchors-per-step", type=int, help="Blocks per optimizer step.")
@click.option("--anchors-per-seq", type=int, help="Anchors drawn from one conversation per batch row.")
@click.option("--lr", type=float)
@click.option("--weight-decay", type=float)
@click.option("--warmup-steps", type=int)
@click.option("--loss-decay", type=float, help="Drafted slot j weighs exp(-(j-1) / loss_decay); 0: equal.")
@click.option("--labels", type=click.Choice(["argmax", "dataset"]), help="Train on the target's greedy tokens "
              "(default) or the dataset's tokens.")
@click.option("--kl-weight", type=float, help="Add this times the cross-entropy against the stored top-K "
              "distribution (a run captured with --topk).")
@click.option("--head-vocab", type=click.Choice(["train-labels", "full"]))
@click.option("--draft-vocab-size", type=int, help="Score only the N most frequent train labels (0: all).")
@click.option("--heldout-fraction", type=float, help="Held-out share by sample_id hash (default 0.1).")
@click.option("--train-rows", type=int, help="Train on the first N train conversations of the run (0: all).")
@click.option("--train-anchors", type=int, help="Train on the first train conversations that hold N valid anchors "
              "(0: no limit): equal supervision across runs of different answer lengths.")
@click.option("--eval-anchors", type=int, help="Held-out anchors scored, evenly spaced (0: all).")
@click.option("--precision", type=click.Choice(["auto", "bfloat16", "float32"]),
              help="Autocast dtype of the forward (auto: bfloat16 where the CPU computes it natively, else float32).")
@click.option("--workers", type=int, help="DataLoader processes decoding conversations (default 1; 0: none).")
@click.option("--shuffle-buffer", type=int, help="Rows of the stream's shuffle buffer (default 1024).")
@click.option("--checkpoint-every", type=int, help="Steps between training checkpoints (default 100); a trainer "
              "started again with the same --out resumes from the latest.")
@click.option("--vocab-warmup", type=int, help="--online: train conversations whose labels make the head "
              "vocabulary (default 64; the first step waits for them).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def drafter_train(config_file, no_progress, as_json, **flags) -> None:
    """Train a drafter, streamed from the run's shards; score it, the untrained drafter, the bigram and
    prompt-lookup baselines on the held-out split. Under `torchrun --nproc-per-node N -m cli drafter train ...`
    each rank reads its own rows and gradients are averaged. Rerun with the same --out to resume."""
    from drafter import live
    from drafter.config import from_mapping
    from drafter.train import train

    values = _drafter_values(config_file, flags)
    if no_progress:
        values["progress"] = False
    cfg = from_mapping(values)
    result = live.train(cfg) if cfg.online or cfg.follow else train(cfg)
    _emit(result, as_json, _print_drafter_scores)


def _print_drafter_scores(result: dict) -> None:
    rows = [{"model": name, "accept_len": f"{s['accept_len']:.4f}", "with_bonus": f"{s['accept_len_with_bonus']:.4f}",
             "first_token_acc": f"{s['first_token_acc']:.4f}",
             "slot_acc": " ".join(f"{x:.2f}" for x in s["position_acc"]), "blocks": s["blocks"]}
            for name, s in result.items() if isinstance(s, dict) and "accept_len" in s]
    if "data" in result:
        d = result["data"]
        click.echo(f"train: {d['train']['conversations']} conversations, {d['train']['anchors']:,} anchors; held out: "
                   f"{d['heldout']['conversations']} conversations, {d['heldout']['anchors']:,} anchors; "
                   f"{d['overlap_removed']} train rows dropped (a prompt or sample id of the held-out set)")
    if "skipped_trained_on" in result.get("drafter", {}):
        s = result["drafter"]
        click.echo(f"scored {s['conversations']} conversations; {s['skipped_trained_on']} skipped (trained on)")
    _table(rows)
    if "fixed_loss" in result:
        click.echo(f"train loss on fixed anchors: {result['fixed_loss'][0]:.4f} -> {result['fixed_loss'][1]:.4f}; "
                   f"training {result['seconds']} s")


@drafter_group.command("eval")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--run", required=True, help="Capture run folder with the same taps.")
@click.option("--split", type=click.Choice(["heldout", "train", "all"]), default="heldout", show_default=True)
@click.option("--heldout-fraction", type=float, help="Default: the one the drafter was trained with.")
@click.option("--eval-anchors", type=int, help="Anchors scored, evenly spaced (0: all; default: as trained).")
@click.option("--target-dir", type=click.Path(), help="Model folder (default: the one recorded in the checkpoint).")
@click.option("--json", "as_json", is_flag=True)
def drafter_eval(checkpoint, run, split, heldout_fraction, eval_anchors, target_dir, as_json) -> None:
    """Score a saved drafter (acceptance length, first-token accuracy); appends to CHECKPOINT/metrics.jsonl."""
    from pathlib import Path

    from drafter.train import METRICS, evaluate_checkpoint

    score = evaluate_checkpoint(checkpoint, run, split, heldout_fraction, eval_anchors, target_dir)
    with open(Path(checkpoint) / METRICS, "a") as f:
        f.write(json.dumps({"kind": "eval", "model": "checkpoint", "run": str(run), **score}) + "\n")
    _emit(score, as_json, lambda s: _print_drafter_scores({"drafter": s}))


@main.group("provenance")
def provenance_group() -> None:
    """What a run was made from (provenance.json)."""


@provenance_group.command("verify")
@click.argument("run_dir", type=RUN)
@click.option("--json", "as_json", is_flag=True)
def provenance_verify(run_dir, as_json) -> None:
    """Recompute every recorded hash: weight files, chat template, every shard. Exit 1 on a mismatch,
    2 when RUN_DIR holds no run or no valid provenance.json."""
    import dataclasses

    from provenance.verify import verify

    report = verify(run_dir)

    def render(r):
        for m in r["mismatches"]:
            click.echo(f"FAIL {m['kind']} {m['path']}: {m['field']} expected {m['expected']}, actual {m['actual']}")
        verdict = "OK" if not r["mismatches"] else f"{len(r['mismatches'])} mismatch(es)"
        click.echo(f"{verdict}: {r['weights']} weight file(s), {r['shards']} shard(s) rechecked")

    _emit({**dataclasses.asdict(report), "ok": report.ok}, as_json, render)
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("run_dir", type=RUN)
@click.option("--reference", required=True,
              help="The public dataset: a local .json/.jsonl/.parquet/.arrow file, `sharegpt`, or a hub id.")
@click.option("--source-column", default="source", show_default=True, help="The reference's source column.")
@click.option("--split", default="train", show_default=True, help="Reference split (hub datasets).")
@click.option("--model-path", type=click.Path(), help="The run's tokenizer folder (default: from provenance.json).")
@click.option("--max-diagnoses", default=1000, show_default=True, help="Unmatched rows diagnosed at most.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of Markdown.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def audit(run_dir, reference, source_column, split, model_path, max_diagnoses, as_json, no_progress) -> None:
    """Match every captured conversation token by token against the public dataset: exact, truncated,
    regenerated, engine-made and unmatched rows (diagnosed), per-source tables, reference rows never
    captured, greedy agreement. Markdown for a model card, or --json. Exit 1 when any row is unmatched."""
    from provenance.audit import as_json as to_json, audit as run_audit, markdown

    report = run_audit(run_dir, reference, source_column=source_column, split=split, model_path=model_path,
                       max_diagnoses=max_diagnoses, progress=not no_progress)
    click.echo(to_json(report) if as_json else markdown(report))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
