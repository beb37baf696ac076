"""``capture``: the command line (click). Thin: every command calls one library function.

User errors (:class:`capture.errors.CaptureError`) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import json
import logging
import sys

import click

from capture.errors import CaptureError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CaptureError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


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
         "weights": r["quantization"], "engine": r["engine"], "source": r["source"]} for r in rs]))


@main.command()
@click.option("--config", "config_file", type=click.Path(), help="YAML file of run settings; flags override it.")
@click.option("--out", help="Run folder (shards + manifest.jsonl). Rerun the same command to resume.")
@click.option("--target", help="Preset (see `capture targets`) or a local model folder.")
@click.option("--model-path", type=click.Path(), help="Local weights for a preset target (default: HF cache).")
@click.option("--dataset", help="`sharegpt`, a local .json/.jsonl/.parquet/.arrow file, or a hub id.")
@click.option("--split", help="Dataset split (default train).")
@click.option("--layers", help="Comma-separated taps: output of decoder layer k, 0-based.")
@click.option("--final", type=click.Choice(["none", "post-norm", "pre-norm"]), help="Also store the final state.")
@click.option("--argmax/--no-argmax", default=None, help="Store the target's greedy next token (default on).")
@click.option("--limit", type=int, help="Read at most N dataset rows (counted before any filter).")
@click.option("--sources", help="Keep only these comma-separated sources.")
@click.option("--exclude-sources", help="Drop these comma-separated sources.")
@click.option("--source-cap", "source_caps", multiple=True, help="SOURCE=N: at most N rows of SOURCE (repeatable).")
@click.option("--alternation", type=click.Choice(["normalize", "skip"]), help="Rows breaking user/assistant alternation.")
@click.option("--chat-template", type=click.Path(), help="Jinja chat template file overriding the tokenizer's.")
@click.option("--system-prompt", help="System turn added to conversations that have none.")
@click.option("--special-text", type=click.Choice(["drop", "keep"]), help="Rows whose text contains special-token strings.")
@click.option("--min-tokens", type=int)
@click.option("--max-tokens", type=int)
@click.option("--min-loss-tokens", type=int)
@click.option("--overlength", type=click.Choice(["drop", "truncate"]), help="Over --max-tokens / model context.")
@click.option("--dedup/--no-dedup", default=None, help="Drop exact duplicates by token_sha256.")
@click.option("--codec", type=click.Choice(["bf16", "bf16-split", "fp8-e4m3"]),
              help="State codec (default bf16-split, lossless; fp8-e4m3 is lossy, 0.43x).")
@click.option("--codec-threads", type=int, help="Encoder threads per replica (default 2).")
@click.option("--shard-size", help="Target shard size, e.g. 512MiB.")
@click.option("--batch-tokens", type=int, help="Padded tokens per forward.")
@click.option("--unit-tokens", type=int, help="Tokens per work unit sent to a replica.")
@click.option("--replicas", type=int)
@click.option("--cpus-per-replica", type=int)
@click.option("--ray-address", help="Ray cluster address (default: start a local instance).")
@click.option("--engine", type=click.Choice(["hf"]))
@click.option("--disk-reserve", help="Free space to keep on the output disk, e.g. 1GiB (default 64MiB).")
@click.option("--dry-run", is_flag=True, default=None, help="Print the plan (records, tokens, bytes); write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def run(config_file, as_json, no_progress, **flags) -> None:
    """Capture hidden states (resumes an existing run folder)."""
    from capture.config import from_mapping, load_yaml
    from capture.driver import run as run_capture

    values = load_yaml(config_file) if config_file else {}
    if not flags["source_caps"]:
        flags.pop("source_caps")
    values.update({k: v for k, v in flags.items() if v is not None})
    if no_progress:
        values["progress"] = False
    cfg = from_mapping(values)
    summary = run_capture(cfg).as_dict()
    _emit(summary, as_json, _print_summary)


def _print_summary(s: dict) -> None:
    if s["estimated_tokens"] is not None:
        click.echo(f"plan for {s['out']}: {s['kept']} records, {s['estimated_tokens']:,} tokens, "
                   f"~{s['estimated_bytes'] / 2**20:,.1f} MiB; {s['free_bytes'] / 2**30:,.1f} GiB free there")
        click.echo("estimated size by codec: " + ", ".join(
            f"{c} {b / 2**20:,.1f} MiB" for c, b in s["estimated_bytes_by_codec"].items()))
    else:
        click.echo(f"{s['out']}: committed {s['committed_rows']} rows, {s['committed_tokens']:,} tokens, "
                   f"{s['shards']} shard(s), {s['committed_bytes'] / 2**20:,.1f} MiB in {s['seconds']} s; "
                   f"run total {s['total_rows']} rows, {s['total_tokens']:,} tokens")
    click.echo(f"rows read {s['rows_read']}, already committed {s['already_committed']}, kept {s['kept']}")
    for title in ("skipped", "rejected", "normalized"):
        if s[title]:
            click.echo(f"{title}: " + ", ".join(f"{k}={v}" for k, v in sorted(s[title].items())))
    if s["truncated_input"]:
        click.echo(f"input: {s['truncated_input']}")


@main.group()
def shards() -> None:
    """Inspect and check a run folder."""


@shards.command("ls")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def shards_ls(run_dir, as_json) -> None:
    """Committed shards, in commit order."""
    from shards.summary import ls

    rows = ls(run_dir)
    _emit(rows, as_json, lambda rs: _table([{**r, "sha256": r["sha256"][:16]} for r in rs]))


@shards.command("stat")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def shards_stat(run_dir, as_json) -> None:
    """Totals, bytes per token, per-source table."""
    from shards.summary import stat

    def render(s):
        for k, v in s.items():
            if k != "sources":
                click.echo(f"{k:28s} {v}")
        _table([{"source": k, **v} for k, v in s.get("sources", {}).items()])

    _emit(stat(run_dir), as_json, render)


@shards.command("head")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-n", default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def shards_head(run_dir, n, as_json) -> None:
    """The first rows: ids, lengths, state norms."""
    from shards.summary import head

    _emit(head(run_dir, n), as_json, lambda rows: [click.echo(json.dumps(r)) for r in rows])


@shards.command("verify")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
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
        state = "complete" if r["complete"] else "incomplete (no completion record yet)"
        verdict = "OK" if not r["problems"] else f"{len(r['problems'])} problem(s)"
        click.echo(f"{verdict}: {r['shards']} shards, {r['rows']} rows, {r['tokens']:,} tokens; run {state}")

    _emit(dataclasses.asdict(report), as_json, render)
    sys.exit(0 if report.ok else 1)


@shards.command("recode")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--codec", required=True, type=click.Choice(["bf16", "bf16-split", "fp8-e4m3"]))
@click.option("--shard-size", default="512MiB", show_default=True)
@click.option("--threads", default=2, show_default=True, help="Encoder threads.")
def shards_recode(src, dst, codec, shard_size, threads) -> None:
    """Copy a run into DST with its states stored in another codec (rerun to resume)."""
    from capture.config import parse_size
    from shards.recode import recode

    c = recode(src, dst, codec, shard_size=parse_size(shard_size), threads=threads)
    click.echo(f"{dst}: recoded {c['rows']} rows into {c['shards']} shard(s), {c['bytes'] / 2**20:,.1f} MiB "
               f"({c['already']} already there)")


@shards.command("gc")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--dry-run", is_flag=True, help="List what would be removed.")
def shards_gc(run_dir, dry_run) -> None:
    """Remove shard files no manifest line names (left by interrupted runs). Refused while a capture
    writes to RUN_DIR, and in a folder that holds no run."""
    from shards.manifest import gc

    for path in gc(run_dir, dry_run):
        click.echo(f"{'would remove' if dry_run else 'removed'} {path.name}")


if __name__ == "__main__":
    main()
