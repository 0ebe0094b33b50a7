"""GPU-hours spent per useful GPU-hour for a long job chained over sudden-death sessions.

A Monte Carlo model of a 40-GPU-hour job on Kaggle: sessions capped at 12 h, sessions that die at
random (a Poisson process; by default one death per 12 h of session time on average), a restart cost
per session (image start, data load from the cache, restore), and either
  - kchain: a checkpoint every 10 minutes of wall time, a deadline guard that stops at
    limit - margin, saves and publishes; a death loses the work since the last checkpoint;
  - baseline: save only at the end of a session; a death loses the whole session.
It prints both ratios (spent / useful) from one run with the same random deaths.

    python bench/chain_waste.py [--job-hours 40] [--deaths-per-12h 1] [--trials 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics


def simulate(job_h, cadence_h, limit_h, margin_h, restart_h, save_h, publish_h, rate_per_h, rng, save_at_end):
    done = spent = 0.0
    sessions = 0
    while done < job_h - 1e-9:
        sessions += 1
        death = rng.expovariate(rate_per_h) if rate_per_h > 0 else float("inf")
        budget = limit_h - margin_h - restart_h  # training time before the deadline guard stops
        need = job_h - done
        train_h = min(budget, need)
        if death < restart_h + train_h:
            # The session dies: the GPU time up to the death is spent.
            spent += death
            trained = max(0.0, death - restart_h)
            if not save_at_end:
                done += int(trained / cadence_h) * cadence_h  # back to the last checkpoint
            continue
        # The session reaches its end (deadline or finished): save and publish, then stop.
        spent += restart_h + train_h + save_h + publish_h
        if not save_at_end:
            spent += int(train_h / cadence_h) * save_h
        done += train_h
    return spent, sessions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job-hours", type=float, default=40.0)
    ap.add_argument("--deaths-per-12h", type=float, default=1.0)
    ap.add_argument("--cadence-min", type=float, default=10.0)
    ap.add_argument("--limit-h", type=float, default=12.0)
    ap.add_argument("--margin-min", type=float, default=15.0)
    ap.add_argument("--restart-min", type=float, default=3.0, help="image start + cached data load + restore")
    ap.add_argument("--save-s", type=float, default=0.5, help="training stall per checkpoint (bench/checkpoint_overhead.py)")
    ap.add_argument("--publish-min", type=float, default=2.0, help="state dataset upload at the end of a session")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rate = a.deaths_per_12h / 12.0
    common = dict(
        job_h=a.job_hours, cadence_h=a.cadence_min / 60, limit_h=a.limit_h, margin_h=a.margin_min / 60,
        restart_h=a.restart_min / 60, save_h=a.save_s / 3600, publish_h=a.publish_min / 60, rate_per_h=rate,
    )
    results = {}
    for name, at_end in (("kchain (10-minute cadence)", False), ("save-at-end baseline", True)):
        rng = random.Random(a.seed)  # the same deaths for both policies
        runs = [simulate(**common, rng=rng, save_at_end=at_end) for _ in range(a.trials)]
        ratios = sorted(s / a.job_hours for s, _ in runs)
        results[name] = (statistics.mean(ratios), ratios[int(0.95 * len(ratios)) - 1],
                         statistics.mean(n for _, n in runs))

    print(f"job {a.job_hours:g} GPU-h, sessions of {a.limit_h:g} h (margin {a.margin_min:g} min), "
          f"{a.deaths_per_12h:g} random death(s) per 12 h of session time, restart {a.restart_min:g} min, "
          f"{a.trials} trials")
    print(f"{'policy':<28} {'spent/useful':>12} {'p95':>8} {'sessions':>9}")
    for name, (mean, p95, sessions) in results.items():
        print(f"{name:<28} {mean:>12.3f} {p95:>8.3f} {sessions:>9.1f}")
    kchain = results["kchain (10-minute cadence)"][0]
    base = results["save-at-end baseline"][0]
    print(f"kchain spends {kchain:.3f} GPU-h per useful GPU-h (target <= 1.05); "
          f"the baseline spends {base / kchain:.2f}x as much as kchain")


if __name__ == "__main__":
    main()
