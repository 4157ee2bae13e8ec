//! The soak's report: a traffic phase's table of outcomes, its samples' growth and slope
//! against the targets, the stop; the watchdog phase's line; the samples written out.

use super::*;

/// Write a phase's samples, one per line, to `target/soak/<engine>.tsv` (for a plot, or to
/// read which part of RSS moved); a write that fails is said and skipped.
pub(super) fn write_samples(ws: &Workspace, phase: &PhaseRun) {
    let dir = ws.root.join("target/soak");
    let path = dir.join(format!(
        "{}.tsv",
        match phase.engine {
            Engine::Cpu => "cpu",
            Engine::Inproc => "inproc",
        }
    ));
    let mut text = format!("{}\n", Sample::HEADER);
    for s in &phase.samples {
        text.push_str(&s.row());
        text.push('\n');
    }
    match std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&path, text)) {
        Ok(()) => println!("  samples: {}", path.display()),
        Err(e) => println!("  samples not written to {}: {e}", path.display()),
    }
}

/// Print a traffic phase's report; true when every target is met.
pub(super) fn report(phase: &PhaseRun) -> bool {
    let PhaseRun {
        engine,
        minutes,
        outcomes,
        samples,
        stop_s,
        left,
    } = phase;
    let fault = if *engine == Engine::Cpu {
        ", the backend SIGSTOPped 3 s at 40 %"
    } else {
        ""
    };
    println!(
        "soak, {}: {minutes} min, {CLIENTS} clients, {IDLE_POOL} idle keep-alive connections{fault}",
        engine.name()
    );
    println!(
        "  {:<18} {:>8} {:>8} {:>11} {:>10}",
        "request", "expected", "as such", "unexpected", "corrupted"
    );
    let allowed = |o: &Outcome, kind: Kind| {
        o.status == kind.expected() || (o.in_fault && matches!(o.status, 502 | 503))
    };
    let mut unexpected_total = 0;
    let mut corrupted_total = 0;
    let mut kinds_unrun = 0;
    for kind in KINDS {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.kind == kind).collect();
        // A kind that never ran proves nothing: the phase is too short for its traffic.
        kinds_unrun += usize::from(mine.is_empty());
        let good = mine.iter().filter(|o| allowed(o, kind)).count();
        let corrupted = mine.iter().filter(|o| o.corrupted && !o.in_fault).count();
        let bad: Vec<u16> = mine
            .iter()
            .filter(|o| !allowed(o, kind))
            .map(|o| o.status)
            .collect();
        unexpected_total += bad.len();
        corrupted_total += corrupted;
        println!(
            "  {:<18} {:>8} {:>8} {:>11} {:>10}{}",
            format!("{kind:?}"),
            kind.expected(),
            good,
            bad.len(),
            corrupted,
            if bad.is_empty() {
                String::new()
            } else {
                format!("  (statuses {bad:?})")
            }
        );
    }
    if *engine == Engine::Cpu {
        let faulted = outcomes
            .iter()
            .filter(|o| o.in_fault && matches!(o.status, 502 | 503))
            .count();
        let in_fault = outcomes.iter().filter(|o| o.in_fault).count();
        println!(
            "  {in_fault} request(s) met the SIGSTOP window; {faulted} of them answered 502/503 (allowed there)"
        );
    }
    // Warm-up: the first minute, or the first third of a short phase.
    let warm = (minutes * 60.0 / 3.0).min(WARM_UP_S);
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at_s >= warm).collect();
    let slope = |f: &dyn Fn(&Sample) -> f64| -> f64 {
        let n = after.len() as f64;
        if n < 2.0 {
            return 0.0;
        }
        let mx = after.iter().map(|s| s.at_s).sum::<f64>() / n;
        let my = after.iter().map(|s| f(s)).sum::<f64>() / n;
        let num: f64 = after.iter().map(|s| (s.at_s - mx) * (f(s) - my)).sum();
        let den: f64 = after.iter().map(|s| (s.at_s - mx).powi(2)).sum();
        if den == 0.0 { 0.0 } else { num / den * 60.0 }
    };
    let growth = |f: &dyn Fn(&Sample) -> u64| -> i64 {
        match (after.first(), after.last()) {
            (Some(first), Some(last)) => f(last) as i64 - f(first) as i64,
            _ => 0,
        }
    };
    // RSS moves by a few hundred KiB between two looks (requests in flight, the heap's
    // trims every 5 s), so its growth compares the medians of the window's two ends.
    let median_growth = |f: &dyn Fn(&Sample) -> u64| -> i64 {
        let points: Vec<(f64, u64)> = after.iter().map(|s| (s.at_s, f(s))).collect();
        median_growth(&points)
    };
    let rss_growth = median_growth(&|s| s.rss_kib);
    let fd_growth = growth(&|s| s.fds);
    let tasks_seen = after.iter().all(|s| s.tasks.is_some()) && !after.is_empty();
    let task_growth = growth(&|s| s.tasks.unwrap_or(0));
    let rss_judged = rss_is_judged(warm, minutes * 60.0);
    let cache = if after.iter().any(|s| s.prompt_cache_kib.is_some()) {
        format!(
            ", the add-on's prompt cache {:+} KiB",
            median_growth(&|s| s.prompt_cache_kib.unwrap_or(0))
        )
    } else {
        String::new()
    };
    println!(
        "  serve after warm-up ({} samples from {warm:.0} s): RSS {:+.0} KiB/min (grew {rss_growth} KiB, median of the last {END_WINDOW_S:.0} s against the first, or of a third each in a shorter window: anonymous {:+}, file-backed {:+}{cache}; {}), FDs {:+.2}/min (grew {fd_growth}; slack {FD_SLACK}), tasks {:+.2}/min (grew {task_growth}; slack {TASK_SLACK}; last {}), threads {}",
        after.len(),
        slope(&|s| s.rss_kib as f64),
        median_growth(&|s| s.rss_anon_kib),
        median_growth(&|s| s.rss_file_kib),
        if rss_judged {
            format!("limit {GROWTH_LIMIT_KIB}")
        } else {
            format!(
                "not judged: the phase is under {:.0} min",
                (WARM_UP_S + JUDGED_WINDOW_S) / 60.0
            )
        },
        slope(&|s| s.fds as f64),
        slope(&|s| s.tasks.unwrap_or(0) as f64),
        after
            .last()
            .and_then(|s| s.tasks)
            .map_or("not scraped".to_string(), |n| n.to_string()),
        after.last().map(|s| s.threads).unwrap_or(0)
    );
    println!("  stop: SIGTERM to exit {stop_s:.2} s; processes left: {left:?}");
    if kinds_unrun > 0 {
        println!("  {kinds_unrun} kind(s) of request never ran: a longer --minutes runs them all");
    }
    let met = unexpected_total == 0
        && corrupted_total == 0
        && kinds_unrun == 0
        && (!rss_judged || rss_growth <= GROWTH_LIMIT_KIB)
        && fd_growth <= FD_SLACK
        && tasks_seen
        && task_growth <= TASK_SLACK
        && left.is_empty();
    println!("  {}", if met { "targets met" } else { "targets MISSED" });
    met
}

/// How long each end of the window is whose medians [`median_growth`] compares (at most a
/// third of the window).
const END_WINDOW_S: f64 = 60.0;

/// How much a series of (time, value) points grew: the median of its last [`END_WINDOW_S`]
/// against the median of its first (each end at most a third of the series' span; a single
/// point at each end when the span is shorter than three samples).
pub(super) fn median_growth(points: &[(f64, u64)]) -> i64 {
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return 0;
    };
    let span = last.0 - first.0;
    let end = END_WINDOW_S.min(span / 3.0);
    let median = |mut values: Vec<u64>| -> i64 {
        values.sort_unstable();
        values.get(values.len() / 2).copied().unwrap_or(0) as i64
    };
    let head: Vec<u64> = points
        .iter()
        .filter(|p| p.0 <= first.0 + end)
        .map(|p| p.1)
        .collect();
    let tail: Vec<u64> = points
        .iter()
        .filter(|p| p.0 >= last.0 - end)
        .map(|p| p.1)
        .collect();
    median(tail) - median(head)
}

/// Whether a phase of `length_s` seconds, warm after `warm_s`, is long enough for its RSS to be
/// judged: a full warm-up minute, then a window of [`JUDGED_WINDOW_S`].
pub(super) fn rss_is_judged(warm_s: f64, length_s: f64) -> bool {
    warm_s >= WARM_UP_S && length_s - warm_s >= JUDGED_WINDOW_S
}

/// Print the watchdog phase's report; true when serve killed the hung backend, said so, exited
/// 1 within the limit and its slack, and left nothing running.
pub(super) fn report_watchdog(run: &WatchdogRun) -> bool {
    println!(
        "soak, watchdog kill: backend SIGSTOPped mid-stream under --watchdog {WATCHDOG_S}: serve exited {} after {:.2} s (bound {} s), its line {}, processes left: {:?}",
        run.code
            .map_or("not at all".to_string(), |c| format!("with {c}")),
        run.exit_s,
        WATCHDOG_S + WATCHDOG_SLACK_S,
        if run.said { "printed" } else { "MISSING" },
        run.left
    );
    let met = run.code == Some(1)
        && run.said
        && run.exit_s <= (WATCHDOG_S + WATCHDOG_SLACK_S) as f64
        && run.left.is_empty();
    println!("  {}", if met { "targets met" } else { "targets MISSED" });
    met
}

#[cfg(test)]
mod tests {
    use super::{median_growth, rss_is_judged};

    #[test]
    fn growth_compares_the_medians_of_the_two_ends() {
        // Flat at 8,000 KiB with one high and one low look at the ends: no growth.
        let mut flat: Vec<(f64, u64)> = (0..=60).map(|i| (i as f64 * 10.0, 8_000)).collect();
        flat[0].1 = 7_000;
        flat[60].1 = 9_500;
        assert_eq!(median_growth(&flat), 0);
        // A step of 2,000 KiB half way: all of it.
        let step: Vec<(f64, u64)> = (0..=60)
            .map(|i| (i as f64 * 10.0, if i < 30 { 8_000 } else { 10_000 }))
            .collect();
        assert_eq!(median_growth(&step), 2_000);
        // Too few points for windows: the ends themselves.
        assert_eq!(median_growth(&[(0.0, 5), (10.0, 9)]), 4);
        assert_eq!(median_growth(&[]), 0);
    }

    #[test]
    fn rss_is_judged_only_after_a_full_warm_up_and_a_minute_of_window() {
        // The suite's minute: two half-minute phases, warm after 10 s.
        assert!(!rss_is_judged(10.0, 30.0));
        // Warm after the first minute, but only 30 s after it.
        assert!(!rss_is_judged(60.0, 90.0));
        assert!(rss_is_judged(60.0, 120.0));
        // The default run: two 10-minute phases.
        assert!(rss_is_judged(60.0, 600.0));
    }
}
