"""Ranking mode of recipes/train.py (`--rounds N`): the implementations take turns on one model, so that a difference
of a few percent between them can be told from the machine's drift.

The default mode trains each implementation for minutes, one after another: a GPU whose speed drifts between those
minutes (clocks, a neighbour, the allocator's state) ranks them by when they ran. Here one model is built and
prepared once; each implementation runs its warm-up steps, then every round runs each implementation for `steps`
steps on the same batches, switching the attention implementation in between (transformers reads
config._attn_implementation at every forward), with the order rotated each round (ABC, BCA, CAB, ...). Drift then
hits every implementation alike, and each round gives a paired ratio against sdpa on identical tokens: the range of
those ratios says whether a difference is real.

What it gives up: the implementations train one model in turn, so the loss curves are no parity check (the default
mode's are). Peak memory is each implementation's own (reset before each of its turns) over the same weights and
optimizer state.
"""

from __future__ import annotations

import statistics

import torch

import measure

OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


def orders(implementations: list[str], rounds: int) -> list[list[str]]:
    """Round r runs the implementations rotated by r: each takes every position equally often over len() rounds."""
    n = len(implementations)
    return [implementations[r % n:] + implementations[: r % n] for r in range(rounds)] if n else []


SLOW_STEP = 3.0  # a step over this many times its implementation's median step is reported apart (`slow_steps`)


def paired_ratios(base_ms: list[float], impl_ms: list[float]) -> dict:
    """Against the base implementation (sdpa), the ratio of step times on the same batch, base / impl (> 1: impl is
    faster), for each of the steps both ran: their median and quartiles. Unlike tokens/s over a round, one stalled
    step (a multi-second hiccup of the machine) moves the median by one place instead of the whole figure."""
    ratios = sorted(b / t for b, t in zip(base_ms, impl_ms) if t > 0 and b > 0)
    if not ratios:
        return {}
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"vs_sdpa_paired": round(median, 4), "vs_sdpa_paired_q1": round(q1, 4), "vs_sdpa_paired_q3": round(q3, 4)}


def slow_steps(step_ms: list[float], steps_per_round: int, factor: float = SLOW_STEP) -> list[list]:
    """[round, step in round, ms] of each step over `factor` times the median of `step_ms` (round after round)."""
    limit = factor * statistics.median(step_ms)
    return [[i // steps_per_round + 1, i % steps_per_round + 1, round(t, 1)]
            for i, t in enumerate(step_ms) if t > limit]


def switch_implementation(model, impl: str) -> None:
    """fpatch_pf is the "fpatch" implementation with patch_model(model, padding_free=True); the others switch
    plainly (unpatching first restores the implementation patch_model found)."""
    if getattr(model, "_flashpatch_state", None) is not None:
        import flashpatch

        flashpatch.unpatch_model(model)
    model.set_attn_implementation("fpatch" if impl == "fpatch_pf" else impl)
    if impl == "fpatch_pf":
        import flashpatch

        flashpatch.patch_model(model, padding_free=True)


def compare(cfg, accelerator, batches, tokenizer, skip_reasons: dict, build_training, train_step, device_inputs,
            warm_full_rows):
    """(rows, ranking) for `cfg.rounds` rounds; rows are like train.run_implementation's, plus the spread fields.

    batches: warmup_steps + rounds * steps batches; round r uses the r-th run of `steps` after the warm-up ones.
    warm_full_rows: train.warm_full_rows, run in each implementation's warm-up before its first step."""
    from accelerate.utils import gather_object

    device, world, rounds, steps = accelerator.device, accelerator.num_processes, cfg.rounds, cfg.steps
    rows = {i: {"implementation": i, "status": "ok", "reason": None} for i in cfg.implementations}
    for impl in cfg.implementations:
        if skip_reasons.get(impl):
            rows[impl].update(status="skipped", reason=skip_reasons[impl])
    active = [i for i in cfg.implementations if rows[i]["status"] == "ok"]
    info = {"rounds": rounds, "steps_per_round": steps, "orders": orders(active, rounds)}
    if not active:
        return list(rows.values()), info

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model, optimizer, scheduler = build_training(active[0], cfg, accelerator, tokenizer)
    except OOM_ERRORS as exc:  # the one model does not fit: no implementation runs
        for impl in active:
            rows[impl].update(status="OOM", reason=f"building the model: {str(exc).splitlines()[0][:200]}")
        return list(rows.values()), info
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    n_matmul, n_frozen = measure.matmul_params(unwrapped), measure.frozen_matmul_params(unwrapped)
    mcfg = unwrapped.config
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
    attn_width = mcfg.num_attention_heads * head_dim

    nan = float("nan")
    times = {i: [[nan] * steps for _ in range(rounds)] for i in active}  # this rank's seconds, [round][step]
    per = {i: {"losses": [], "compiles": [], "gc_ms": [], "memory": [0.0, 0.0], "rss": 0.0} for i in active}
    gc_pauses, compiles = measure.GcPauses(), measure.TritonCompiles()

    def turn(impl: str, turn_batches: list, round_index: int | None):
        """impl's steps on these batches; round_index None = its warm-up (not timed)."""
        switch_implementation(unwrapped, impl)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for k, batch in enumerate(turn_batches):
            batch_dev = device_inputs(impl, cfg, batch, device)
            if round_index is None and k == 0:
                warm_full_rows(model, optimizer, accelerator, cfg, batch_dev)
            loss, elapsed, step_gc_ms, _, step_compiles = measure.timed_step(
                lambda: train_step(model, optimizer, scheduler, accelerator, cfg, batch_dev), device, gc_pauses,
                compiles)
            per[impl]["losses"].append(accelerator.reduce(loss.detach().float(), reduction="mean").item())
            per[impl]["rss"] = max(per[impl]["rss"], measure.rss_gib() or 0.0)
            if round_index is not None:
                times[impl][round_index][k] = elapsed
                per[impl]["gc_ms"].append(round(step_gc_ms, 2))
                per[impl]["compiles"].append(step_compiles)
        if cuda:
            mem = per[impl]["memory"]
            mem[0] = max(mem[0], torch.cuda.max_memory_allocated(device) / 2**30)
            mem[1] = max(mem[1], torch.cuda.max_memory_reserved(device) / 2**30)

    def run_turn(impl: str, turn_batches: list, round_index: int | None):
        status, reason = "ok", None
        try:
            turn(impl, turn_batches, round_index)
        except OOM_ERRORS as exc:
            status, reason = "OOM", str(exc).splitlines()[0][:200]
        except Exception as exc:  # noqa: BLE001 - one implementation's failure must not stop the others
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            status, reason = "skipped", f"{type(exc).__name__}: {first_line}"
        # One outcome for all ranks: a rank's own failure, else the first failed rank's.
        outcomes = gather_object([(status, reason)])
        failed = [(rank, s, why) for rank, (s, why) in enumerate(outcomes) if s != "ok"]
        if failed:
            if status == "ok":
                rank, status, reason = failed[0]
                reason = f"rank {rank}: {reason}"
            rows[impl].update(status=status, reason=reason)
            active.remove(impl)
            optimizer.zero_grad(set_to_none=True)  # a failed step may leave partial gradients

    for impl in list(active):
        run_turn(impl, batches[: cfg.warmup_steps], None)
    for r, order in enumerate(info["orders"]):
        first = cfg.warmup_steps + r * steps
        for impl in order:
            if impl in active:
                run_turn(impl, batches[first : first + steps], r)

    # Work per round, the same for every implementation (same batches), summed over ranks.
    work = []
    for r in range(rounds):
        round_batches = batches[cfg.warmup_steps + r * steps : cfg.warmup_steps + (r + 1) * steps]
        lengths = [measure.segment_lengths(b) for b in round_batches]
        work.append([sum(map(sum, lengths)), sum(b["input_ids"].numel() for b in round_batches),
                     sum(measure.train_flops(n_matmul, mcfg.num_hidden_layers, attn_width, ln, frozen_params=n_frozen)
                         for ln in lengths)])
    work_per_rank = accelerator.gather(torch.tensor(work, dtype=torch.float64).to(device)).view(world, rounds, 3).cpu()
    work = work_per_rank.sum(dim=0)  # (rounds, [tokens, padded tokens, FLOPs])
    names = list(times)  # every implementation that started; failed ones have NaN times and are not reported
    local = torch.tensor([times[i] for i in names], dtype=torch.float64)  # (impls, rounds, steps)
    local_mem = torch.tensor([per[i]["memory"] + [per[i]["rss"]] for i in names], dtype=torch.float64)
    ranked = accelerator.gather(local.to(device)).view(world, *local.shape).cpu()
    memory = accelerator.gather(local_mem.to(device)).view(world, len(names), 3).cpu()
    model = optimizer = scheduler = unwrapped = None  # freed: the turn closures refer to these names, so no `del`
    accelerator.free_memory()

    peak, _ = measure.peak_tflops(device, cfg.peak_tflops)
    tokens, padded, flops = work[:, 0], work[:, 1], work[:, 2]  # per round, all ranks
    step_s = ranked.amax(dim=0)  # (impls, rounds, steps): a step takes as long as its slowest rank
    round_tps = {i: (tokens / step_s[n].sum(dim=1)).tolist() for n, i in enumerate(names)}
    base = round_tps.get("sdpa") if "sdpa" in active else None
    for n, impl in enumerate(names):
        row = rows[impl]
        row["peak_allocated_gib" if cuda else "peak_rss_gib"] = [
            round(x, 3) for x in memory[:, n, 0 if cuda else 2].tolist()]
        if cuda:
            row["peak_reserved_gib"] = [round(x, 3) for x in memory[:, n, 1].tolist()]
            row["memory_note"] = "max_memory_allocated/reserved per rank over this implementation's turns (reset " \
                                 "before each), the model and optimizer state shared by all implementations"
        else:
            row["memory_note"] = "CPU: process RSS after each of this implementation's steps, the process shared"
        if row["status"] != "ok":
            continue
        seconds = step_s[n].sum().item()
        flat_ms = (1000 * step_s[n].flatten()).tolist()
        tps = round_tps[impl]
        round_median_ms = [1000 * statistics.median(x) for x in step_s[n].tolist()]
        row.update(
            attn_implementation=impl,
            tokens_per_s=tokens.sum().item() / seconds,
            tokens_per_s_per_rank=[round(t / s, 1) for t, s in zip(
                work_per_rank[:, :, 0].sum(dim=1).tolist(), ranked[:, n].sum(dim=(1, 2)).tolist())],
            step_time_ms=statistics.mean(flat_ms),
            step_time_ms_median=statistics.median(flat_ms),
            step_times_ms=[round(t, 2) for t in flat_ms],  # round after round, each step the slowest rank's
            round_tokens_per_s=[round(t, 1) for t in tps],
            round_median_step_ms=[round(t, 2) for t in round_median_ms],
            slow_steps=slow_steps(flat_ms, steps),
            # the implementation's own spread: (max - min) / median of its per-round tokens/s
            round_spread=(max(tps) - min(tps)) / statistics.median(tps),
            gc_ms=per[impl]["gc_ms"],
            triton_compiles=per[impl]["compiles"],
            measured_steps=rounds * steps,
            real_tokens=int(tokens.sum().item()),
            padded_tokens=int(padded.sum().item()),
            padding_fraction=1 - tokens.sum().item() / padded.sum().item(),
            model_tflops_per_s=flops.sum().item() / seconds / 1e12,
            mfu=flops.sum().item() / seconds / (peak * 1e12 * world) if peak else None,
            losses=per[impl]["losses"],
            losses_note="one model trained by every implementation in turn: not a parity check",
            final_loss=per[impl]["losses"][-1],
            n_matmul_params=n_matmul,
            frozen_matmul_params=n_frozen,
        )
    for impl in active if base else ():
        ratios = [t / b for t, b in zip(round_tps[impl], base)]  # paired: same round, same batches
        rows[impl].update(vs_sdpa=rows[impl]["tokens_per_s"] / rows["sdpa"]["tokens_per_s"],
                          vs_sdpa_rounds=[round(x, 4) for x in ratios], vs_sdpa_min=round(min(ratios), 4),
                          vs_sdpa_max=round(max(ratios), 4),
                          **paired_ratios(rows["sdpa"]["step_times_ms"], rows[impl]["step_times_ms"]))
    return list(rows.values()), info


def table(report: dict) -> str:
    """The ranking mode's markdown table: the headline figures with their spread over rounds."""
    on_gpu = report["environment"]["device_type"] == "cuda"
    mem_key, mem_col = ("peak_allocated_gib", "peak alloc GiB") if on_gpu else ("peak_rss_gib", "peak RSS GiB")
    lines = [
        f"| implementation | status | tokens/s | round spread | vs sdpa (rounds min-max) | vs sdpa, paired steps "
        f"(quartiles) | step ms median | {mem_col} per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['implementation']} | {r['status']}: {r.get('reason') or ''}"[:100] + " | - | - | - | - "
                         "| - | - |")
            continue
        vs = paired = "-"
        if r.get("vs_sdpa") is not None:
            vs = f"{r['vs_sdpa']:.3f}x ({r['vs_sdpa_min']:.3f}-{r['vs_sdpa_max']:.3f})"
        if r.get("vs_sdpa_paired") is not None:
            paired = f"{r['vs_sdpa_paired']:.3f}x ({r['vs_sdpa_paired_q1']:.3f}-{r['vs_sdpa_paired_q3']:.3f})"
        mem = " / ".join(f"{x:.2f}" for x in r.get(mem_key) or [])
        lines.append(f"| {r['implementation']} | ok | {r['tokens_per_s']:,.0f} | {100 * r['round_spread']:.1f}% | "
                     f"{vs} | {paired} | {r['step_time_ms_median']:.1f} | {mem} |")
    return "\n".join(lines)


def slow_step_notes(report: dict) -> list[str]:
    """A line per implementation with steps over SLOW_STEP times its median step (`slow_steps`)."""
    notes = []
    for r in report["results"]:
        slow = r.get("slow_steps") or []
        if slow:
            listed = ", ".join(f"round {rnd} step {k}: {ms:,.0f} ms" for rnd, k, ms in slow)
            notes.append(f"\n{r['implementation']}: {len(slow)} of {r['measured_steps']} steps took over "
                         f"{SLOW_STEP:g}x its median step ({listed}); tokens/s and the round ratios count them, the "
                         "median step and the paired ratios barely move.")
    return notes
