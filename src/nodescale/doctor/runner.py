"""The doctor on one rank, step by step, with a deadline on every wait.

1. Every rank gathers its facts (no process group, no other rank needed).
2. It joins the rendezvous store and posts them; rank 0 waits at most ``timeout`` for all.
3. Rank 0 runs the checks and decides: if a blocking problem was found (an interface that
   does not exist, a rank that never came), nobody starts a process group; otherwise every
   rank runs the timed all_reduce (:mod:`.collective`) and posts its measurement.
4. Rank 0 prints the tables (or JSON), writes ``doctor.json`` and announces the end, so the
   other ranks leave only once rank 0 no longer needs the store.

Rank 0 returns the exit code (1 when a check failed); the others return 0 unless they lost
rank 0, then 1 with one line on stderr. Under ``nodescale doctor --nproc N`` rank 0 writes
its exit code to the file named by :data:`~nodescale.doctor.facts.VERDICT_VARIABLE` and
returns 0, so the local launcher does not report a worker failure for a failed check.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nodescale import bad_nodes
from nodescale.atomic_files import write_text_atomic
from nodescale.distributed.env import DistEnv
from nodescale.doctor import collective, evaluate, network, report
from nodescale.doctor.check import Check, fail
from nodescale.doctor.exchange import Exchange, StoreUnavailable, connect
from nodescale.doctor.facts import VERDICT_VARIABLE, RankFacts, gather
from nodescale.doctor.flagged import flagged_hosts

# Extra time a waiting rank allows beyond rank 0's own deadlines, for start-up skew.
SLACK_S = 30.0
# How long rank 0 waits, after printing, for the others to let go of the store it may host.
LEAVE_S = 10.0


@dataclass(frozen=True)
class Options:
    """What the command line asked for."""

    timeout_s: float = 60.0
    backend: str = "auto"  # auto, gloo or nccl
    out: Path | None = None
    json: bool = False


def run(env: DistEnv, options: Options) -> int:
    """This rank's part of the doctor; the exit code for this process."""
    facts = gather(env, options.backend)
    try:
        exchange = connect(env, options.timeout_s)
        exchange.claim()
        exchange.publish("facts", facts.to_dict())
    except StoreUnavailable as exc:
        if env.rank == 0 and exc.listening:
            return _alone(env, facts, options, str(exc))
        return _lost(env, facts, str(exc))
    except Exception as exc:  # the store went away between connecting and posting
        return _lost(env, facts, f"the rendezvous store failed: {exc}")
    import torch.distributed as dist

    try:
        if env.rank == 0:
            return _lead(env, exchange, facts, options)
        return _follow(env, exchange, facts, options)
    except dist.DistError as exc:  # the store's host went away mid-run (torchrun's agent killed, ...)
        return _lost(env, facts, f"the rendezvous store failed: {type(exc).__name__}: {exc}")


def _lead(env: DistEnv, exchange: Exchange, mine: RankFacts, options: Options) -> int:
    reported, missing = exchange.gather("facts", options.timeout_s)
    facts = {rank: RankFacts.from_dict(data) for rank, data in reported.items()}
    facts[0] = mine
    claims = exchange.claims(sorted(facts))
    backend = evaluate.choose_backend(options.backend, mine)
    master = f"{env.master_addr}:{env.master_port}"
    rows = evaluate.before_collective(facts, env.world_size, missing, claims, options.timeout_s,
                                      network.store_row(exchange.mode, master), exchange.mode, backend)
    plan = evaluate.plan(rows, facts, backend)
    exchange.announce("plan", plan.to_dict())
    results: dict[int, Any] = {}
    missing_results: list[int] = []
    if plan.run:
        exchange.publish("result", collective.run(env, backend, options.timeout_s, plan.partners))
        results, missing_results = exchange.gather("result", 2 * options.timeout_s)
    rows += evaluate.after_collective(plan, results, missing_results, facts, env.world_size, options.timeout_s)
    code = _emit(report.document(rows, facts, missing, results, plan, env.world_size, options.timeout_s), options)
    flagged = flagged_hosts(results, {rank: f.host for rank, f in facts.items()}, env.world_size)
    for line in bad_nodes.record(flagged, options.out, "doctor"):  # stdout stays JSON under --json
        print(line, file=sys.stderr if options.json else sys.stdout, flush=True)
    exchange.announce("done", {"exit_code": code})
    exchange.wait_until_left(len(facts) - 1, min(options.timeout_s, LEAVE_S))
    return _verdict(code)


def _follow(env: DistEnv, exchange: Exchange, facts: RankFacts, options: Options) -> int:
    # Rank 0 may wait `timeout` for the slowest rank before it decides.
    plan = exchange.wait_for("plan", 2 * options.timeout_s + SLACK_S)
    if plan is None:
        return _lost(env, facts, f"no plan from rank 0 within {2 * options.timeout_s + SLACK_S:g} s")
    if plan["run"]:
        result = collective.run(env, plan["backend"], options.timeout_s, plan["partners"])
        try:
            exchange.publish("result", result)
        except Exception as exc:
            return _lost(env, facts, f"could not hand the all_reduce result to rank 0: {exc}")
    exchange.leave(3 * options.timeout_s + SLACK_S)
    return 0


def _alone(env: DistEnv, facts: RankFacts, options: Options, error: str) -> int:
    """Rank 0 without a store (its port is taken): the table of what it knows about itself."""
    master = f"{env.master_addr}:{env.master_port}"
    rows: list[Check] = [
        replace(row, status="fail", detail="not gathered: rank 0 could not start the rendezvous store",
                hint="see network.master_port")
        if row.name == "launch.ranks_reported" else row
        for row in evaluate.before_collective({0: facts}, env.world_size, [], {0: 1}, options.timeout_s,
                                              network.store_row("rank0", master, error), "rank0",
                                              evaluate.choose_backend(options.backend, facts))
    ]
    rows.append(fail("allreduce.result", "not run: no rendezvous store", "fix network.master_port above"))
    return _verdict(_emit(report.document(rows, {0: facts}, list(range(1, env.world_size)), {}, None,
                                          env.world_size, options.timeout_s), options))


def _lost(env: DistEnv, facts: RankFacts, why: str) -> int:
    """A rank that cannot reach rank 0: one line on its own stderr; rank 0 reports it missing."""
    print(f"nodescale doctor: rank {env.rank} on {facts.host}: {why}\n  hint: check MASTER_ADDR="
          f"{env.master_addr} and MASTER_PORT={env.master_port} from this node, and rank 0's output",
          file=sys.stderr, flush=True)
    return 1


def _emit(doc: dict[str, Any], options: Options) -> int:
    if options.json:
        print(json.dumps(doc, indent=2), flush=True)
    else:
        report.print_tables(doc)
    if options.out is not None:
        path = report.write(options.out, doc)
        if not options.json:
            print(f"report: {path}", flush=True)
    sys.stdout.flush()
    return int(doc["exit_code"])


def _verdict(code: int) -> int:
    """Under ``--nproc``, hand the exit code to the parent through a file and exit 0 (see module doc)."""
    path = os.environ.get(VERDICT_VARIABLE)
    if not path:
        return code
    write_text_atomic(Path(path), str(code))
    return 0

