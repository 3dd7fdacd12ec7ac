"""`castor checkpoints export`: a persisted checkpoint as one standard DCP directory."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from services.cli import render
from services.cli.client import CliClient, CliError, resolve_job
from services.cli.render import format_bytes, print_json, transfer_text


def checkpoints_export(client: CliClient, args: argparse.Namespace) -> int:
    """Download a persisted checkpoint's shards and write them as one standard DCP directory."""
    job = resolve_job(client, args.job)
    persisted = client.run(client.api.checkpoints(job["id"]))
    have = ", ".join(str(c.iteration) + ("" if c.complete else " (incomplete)") for c in persisted)
    in_memory = (
        "an iteration held only in memory is exported from the job's ranks with worker_lib.export_dcp "
        '(docs/training.md, "torch.distributed.checkpoint (DCP)")'
    )
    if args.iteration is None:
        chosen = next((c for c in persisted if c.complete), None)
        if chosen is None:
            raise CliError(
                f"job {job['name']} has no complete persisted checkpoint ({have or 'none'}); {in_memory}"
            )
    else:
        chosen = next((c for c in persisted if c.iteration == args.iteration), None)
        if chosen is None:
            raise CliError(
                f"job {job['name']} has no persisted checkpoint of iteration {args.iteration} (persisted: "
                f"{have or 'none'}); {in_memory}"
            )
    if not chosen.complete:
        ranks = sorted(s.rank for s in chosen.shards)
        generations = sorted({s.generation for s in chosen.shards})
        condemned = [s for s in chosen.shards if s.condemned]
        if condemned:
            why = "; ".join(f"rank {s.rank}'s shard could not be restored: {s.condemned}" for s in condemned)
        elif len(generations) == 1:
            why = f"ranks {ranks} only"
        else:
            why = f"its shards are of generations {generations}: some of a history the job rolled back from"
        raise CliError(f"iteration {chosen.iteration} of job {job['name']} is incomplete ({why})")
    shards = sorted(chosen.shards, key=lambda s: s.rank)
    if [s.rank for s in shards] != list(range(len(shards))):
        raise CliError(f"iteration {chosen.iteration}: the shards' ranks are not 0..{len(shards) - 1}")
    target = Path(args.to)

    from worker_lib.errors import CheckpointError
    from worker_lib.export import export_persisted, persisted_store

    endpoint = (
        args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    console = render.stderr_console()
    bar = render.transfer_progress(console, console.is_terminal and not args.json)
    task = bar.add_task("", total=None)

    def progress(phase: str, done: int, total: int) -> None:
        # One bar for both phases: each starts it over with its own total (ranks, then bytes). A phase's
        # end is drawn at once: a small export can finish between two of rich's timed refreshes.
        bar.update(
            task,
            completed=done,
            total=total or 1,
            description=transfer_text(phase, done, total),
            refresh=done >= total,
        )

    started = time.monotonic()
    with export_directory(target), client.python_ctrl_c():
        bar.start()
        try:
            store = persisted_store(chosen.location, shards[0].key, endpoint_url=endpoint)
            metadata = export_persisted(
                store,
                [(s.key, s.digest) for s in shards],
                chosen.iteration,
                target,
                scratch=args.scratch or target.resolve().parent,
                progress=progress,
            )
        except (CheckpointError, OSError) as exc:
            raise CliError(f"exporting iteration {chosen.iteration}: {exc}") from None
        except ImportError as exc:  # an S3 tier without the s3 extra (aioboto3)
            raise CliError(
                f"exporting iteration {chosen.iteration}: {exc}; pip install 'castor[s3]'"
            ) from None
        except Exception as exc:
            # The S3 client's own errors (no credentials, access denied, an endpoint that does not answer)
            # are the user's to fix: said in one line, not as a traceback.
            if not type(exc).__module__.startswith(("botocore", "aiobotocore")):
                raise
            raise CliError(f"exporting iteration {chosen.iteration} from {chosen.location}: {exc}") from None
        finally:
            bar.stop()
    document = {
        "job": job["name"],
        "iteration": chosen.iteration,
        "ranks": len(shards),
        "directory": str(target.resolve()),
        "entries": len(metadata.state_dict_metadata),
        "bytes": sum(f.stat().st_size for f in target.iterdir() if f.is_file()),
        "seconds": round(time.monotonic() - started, 3),
    }
    if args.json:
        print_json(document)
    else:
        print(
            f"Exported iteration {document['iteration']} of {job['name']} ({document['ranks']} ranks, "
            f"{document['entries']} entries, {format_bytes(document['bytes'])}) to {document['directory']}\n"
            f"Load it with torch.distributed.checkpoint.load(state, "
            f"storage_reader=FileSystemReader({str(document['directory'])!r})), at any world size."
        )
    return 0


@contextlib.contextmanager
def export_directory(target: Path) -> Iterator[None]:
    """Make `target`, or check that it is an empty directory, for the export's files. When the export fails
    or is interrupted, what it wrote is removed again, so that a retry can use the same directory."""
    try:
        existed = target.exists()
        if existed and (not target.is_dir() or any(target.iterdir())):
            raise CliError(f"{target} exists and is not an empty directory")
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission
        raise CliError(f"cannot write the export to {target}: {exc}") from None
    try:
        yield
    except BaseException:
        if existed:
            for entry in list(target.iterdir()):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(target, ignore_errors=True)
        raise
