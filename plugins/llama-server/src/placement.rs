//! ggml-hrx's placement lines (the report and the strict abort) as llama-server prints them, and
//! serve's own lines about them.
//!
//! The formats read (llama.cpp fork #102, `placement_observer` in ggml-hrx.cpp; the prefix up to
//! `placement_observer: ` is the log's own and is skipped):
//!
//! ```text
//! .../ggml-hrx.cpp:431: placement_observer: placement: 512 nodes, 34 off HRX (MUL_MAT x 30, GET_ROWS x 4), 7 graph splits
//! .../ggml-hrx.cpp:431: placement_observer: placement: 512 nodes, 0 off HRX, 1 graph splits
//! .../ggml-hrx.cpp:447: placement_observer: GGML_HRX_STRICT=1: "kq-0" is MUL_MAT f32 ne=[2,2,12,1] and is not placed on HRX; 12 of 152 nodes off HRX (MUL_MAT x 8, SOFT_MAX x 4), 9 splits
//! ```
//!
//! A report line comes once for the first graph with `GGML_HRX_REPORT=1` and once per graph with
//! `GGML_HRX_REPORT=2`; llama-server prints it only at `-lv 4`. The abort line is an error line,
//! printed at any verbosity, just before ggml-hrx aborts the process.

use std::collections::BTreeMap;

const OBSERVER: &str = "placement_observer: ";
const REPORT: &str = "placement: ";
const STRICT: &str = "GGML_HRX_STRICT=1: ";

/// What to do instead, for every line that refuses a placement.
pub const OPT_OUT: &str =
    "Pass --no-strict-device (or set ONEBIT_STRICT_DEVICE=0) to run those nodes on the CPU instead";

/// One graph's placement, from a report line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphPlacement {
    pub nodes: u64,
    pub off: u64,
    /// Nodes off HRX per op, by op name.
    pub off_ops: BTreeMap<String, u64>,
    pub splits: u64,
}

impl GraphPlacement {
    /// `34 of 512 nodes off HRX (GET_ROWS x 4, MUL_MAT x 30), 7 graph splits`, ops by name; or
    /// `all 512 nodes on HRX, 1 graph splits`.
    pub fn describe(&self) -> String {
        if self.off == 0 {
            return format!(
                "all {} nodes on HRX, {} graph splits",
                self.nodes, self.splits
            );
        }
        let ops: Vec<String> = self
            .off_ops
            .iter()
            .map(|(op, n)| format!("{op} x {n}"))
            .collect();
        let ops = if ops.is_empty() {
            String::new()
        } else {
            format!(" ({})", ops.join(", "))
        };
        format!(
            "{} of {} nodes off HRX{ops}, {} graph splits",
            self.off, self.nodes, self.splits
        )
    }
}

/// A placement line, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacementLine {
    /// A report of one graph.
    Report(GraphPlacement),
    /// The strict abort: the text after `GGML_HRX_STRICT=1: ` (the node, then the counts).
    StrictAbort(String),
}

/// Read one backend line; None for any line that is not a placement line (the common case,
/// answered after one substring search).
pub fn parse(line: &str) -> Option<PlacementLine> {
    let at = line.find(OBSERVER)?;
    let rest = line[at + OBSERVER.len()..].trim_end();
    if let Some(what) = rest.strip_prefix(STRICT) {
        return Some(PlacementLine::StrictAbort(what.to_string()));
    }
    parse_report(rest.strip_prefix(REPORT)?).map(PlacementLine::Report)
}

/// `512 nodes, 34 off HRX (MUL_MAT x 30, GET_ROWS x 4), 7 graph splits`.
fn parse_report(text: &str) -> Option<GraphPlacement> {
    let (nodes, rest) = text.split_once(" nodes, ")?;
    let (off, rest) = rest.split_once(" off HRX")?;
    let (ops, rest) = match rest.strip_prefix(" (") {
        Some(inner) => inner.split_once(')')?,
        None => ("", rest),
    };
    let splits = rest.strip_prefix(", ")?.strip_suffix(" graph splits")?;
    let mut off_ops = BTreeMap::new();
    for op in ops.split(", ").filter(|s| !s.is_empty()) {
        let (name, n) = op.rsplit_once(" x ")?;
        *off_ops.entry(name.to_string()).or_insert(0) += n.parse::<u64>().ok()?;
    }
    Some(GraphPlacement {
        nodes: nodes.trim().parse().ok()?,
        off: off.trim().parse().ok()?,
        off_ops,
        splits: splits.trim().parse().ok()?,
    })
}

/// serve's line for a strict abort, without the `1bit serve: ` prefix.
pub fn strict_refusal(what: &str) -> String {
    format!("HRX strict placement refused the model: {what}. {OPT_OUT}")
}

/// What serve watches for in the placement reports of one backend: the worst graph so far.
#[derive(Clone, Debug, Default)]
pub struct Watch {
    /// Say a summary line whenever a graph is worse than every graph before (`--placement-report`).
    pub summarize: bool,
    /// Refuse a report that names nodes off HRX (`--strict-device`).
    pub refuse_off: bool,
    graphs: u64,
    worst: Option<GraphPlacement>,
}

/// What serve makes of one report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub say: Option<String>,
    pub stop: Option<String>,
}

impl Watch {
    pub fn new(summarize: bool, refuse_off: bool) -> Self {
        Self {
            summarize,
            refuse_off,
            ..Default::default()
        }
    }

    /// Take one graph's report.
    pub fn observe(&mut self, graph: GraphPlacement) -> Verdict {
        self.graphs += 1;
        let worse = self.worst.as_ref().is_none_or(|w| graph.off > w.off);
        let mut verdict = Verdict::default();
        if worse {
            if self.summarize {
                let of = if self.graphs > 1 {
                    format!(", worst of {} graphs", self.graphs)
                } else {
                    String::new()
                };
                verdict.say = Some(format!("HRX placement: {}{of}", graph.describe()));
            }
            if self.refuse_off && graph.off > 0 {
                verdict.stop = Some(strict_refusal(&graph.describe()));
            }
            self.worst = Some(graph);
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT_34: &str = "/src/ggml/src/ggml-hrx/ggml-hrx.cpp:431: placement_observer: placement: 512 nodes, 34 off HRX (MUL_MAT x 30, GET_ROWS x 4), 7 graph splits";
    const REPORT_0: &str = "placement_observer: placement: 512 nodes, 0 off HRX, 1 graph splits";
    const ABORT: &str = r#"/src/ggml/src/ggml-hrx/ggml-hrx.cpp:447: placement_observer: GGML_HRX_STRICT=1: "kq-0" is MUL_MAT f32 ne=[2,2,12,1] and is not placed on HRX; 12 of 152 nodes off HRX (MUL_MAT x 8, SOFT_MAX x 4), 9 splits"#;

    #[test]
    fn report_lines_are_read_and_summarized_as_the_specification_prints_them() {
        let Some(PlacementLine::Report(g)) = parse(REPORT_34) else {
            panic!("a report")
        };
        assert_eq!((g.nodes, g.off, g.splits), (512, 34, 7));
        assert_eq!(
            g.describe(),
            "34 of 512 nodes off HRX (GET_ROWS x 4, MUL_MAT x 30), 7 graph splits"
        );
        let Some(PlacementLine::Report(g)) = parse(REPORT_0) else {
            panic!("a report")
        };
        assert_eq!(g.describe(), "all 512 nodes on HRX, 1 graph splits");
        assert_eq!(parse("srv  load_model: loading model"), None);
        assert_eq!(parse("placement_observer: placement: garbage"), None);
    }

    #[test]
    fn the_strict_abort_names_the_node_and_the_opt_out() {
        let Some(PlacementLine::StrictAbort(what)) = parse(ABORT) else {
            panic!("an abort")
        };
        assert_eq!(
            strict_refusal(&what),
            r#"HRX strict placement refused the model: "kq-0" is MUL_MAT f32 ne=[2,2,12,1] and is not placed on HRX; 12 of 152 nodes off HRX (MUL_MAT x 8, SOFT_MAX x 4), 9 splits. Pass --no-strict-device (or set ONEBIT_STRICT_DEVICE=0) to run those nodes on the CPU instead"#
        );
    }

    #[test]
    fn a_summary_is_said_only_when_a_graph_is_worse_than_every_graph_before() {
        let graph = |off: u64| GraphPlacement {
            nodes: 100,
            off,
            off_ops: if off > 0 {
                [("MUL_MAT".to_string(), off)].into()
            } else {
                BTreeMap::new()
            },
            splits: 1 + off,
        };
        let mut w = Watch::new(true, false);
        assert_eq!(
            w.observe(graph(0)).say.as_deref(),
            Some("HRX placement: all 100 nodes on HRX, 1 graph splits")
        );
        assert_eq!(w.observe(graph(0)), Verdict::default());
        assert_eq!(
            w.observe(graph(3)).say.as_deref(),
            Some(
                "HRX placement: 3 of 100 nodes off HRX (MUL_MAT x 3), 4 graph splits, worst of 3 graphs"
            )
        );
        assert_eq!(w.observe(graph(2)), Verdict::default());
        let mut strict = Watch::new(true, true);
        assert_eq!(strict.observe(graph(0)).stop, None);
        let stop = strict.observe(graph(5)).stop.unwrap();
        assert!(
            stop.starts_with("HRX strict placement refused the model: 5 of 100 nodes off HRX")
                && stop.ends_with(OPT_OUT),
            "{stop}"
        );
    }
}
