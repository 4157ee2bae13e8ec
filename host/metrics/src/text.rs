//! serve's own Prometheus text made strict 0.0.4 (what promtool and Lemonade's merge read), and
//! the name of the label that says serve's route.

use std::collections::HashSet;
/// The label naming serve's route on `onebit_up`: `device`, as the specification has it, except
/// when serve runs as Lemonade's llama-server. Lemonade's merge appends its own `device` (and
/// `checkpoint`, `model_name`, `recipe`, `type`) to every series it reads from its llamacpp
/// backend, and a series with `device` twice is refused by Prometheus; there the label is
/// `route`. `under_lemonade`: serve runs as Lemonade's llama-server (the drop-in).
pub fn route_label(under_lemonade: bool) -> &'static str {
    if under_lemonade { "route" } else { "device" }
}

/// prometheus-client's text made strict 0.0.4: a counter's `# HELP` and `# TYPE` name the
/// sample they stand over (`onebit_serve_starts_total`, not the OpenMetrics family name
/// `onebit_serve_starts`), and OpenMetrics' `# EOF` and `# UNIT` lines are left out, so that text
/// appended after it is still read. Called by `/metrics` on each scrape; does not block.
pub fn strict_004(text: &str) -> String {
    let counters: HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .filter(|name| !name.ends_with("_total"))
        .collect();
    let mut out = String::with_capacity(text.len() + 64);
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let described = ["# HELP ", "# TYPE "].into_iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        match described {
            Some(fixed) => out.push_str(&fixed),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counters_help_and_type_name_its_total_sample() {
        let open = "# HELP onebit_serve_starts Loads.\n# TYPE onebit_serve_starts counter\nonebit_serve_starts_total 2\n# HELP onebit_up Up.\n# TYPE onebit_up gauge\nonebit_up{device=\"cpu\"} 1\n# EOF\n";
        assert_eq!(
            strict_004(open),
            "# HELP onebit_serve_starts_total Loads.\n# TYPE onebit_serve_starts_total counter\nonebit_serve_starts_total 2\n# HELP onebit_up Up.\n# TYPE onebit_up gauge\nonebit_up{device=\"cpu\"} 1\n"
        );
    }
}
