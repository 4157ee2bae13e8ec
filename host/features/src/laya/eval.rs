//! The figures docs/laya.md reports: the rule-based classifier's accuracy on the labelled set
//! (tests/laya_cases.json), and the decision's cost on a first turn and on a later one.
//! `cargo xtask laya-eval` prints them (release build); the accuracy is also kept by a test.

use std::time::Instant;

use serde_json::{Value, json};

use super::{Class, Laya, Policy, classify};

/// The labelled set the rules were written against (25 per class).
const CASES: &str = "laya_cases.json";
/// The set written after the first rules were fixed (15 each of code, prose, short); its
/// misses then shaped the final rules, so it is no longer held out.
const HOLDOUT: &str = "laya_cases_holdout.json";
/// The set written after the final rules were fixed, never used to tune them.
const FRESH: &str = "laya_cases_fresh.json";

/// The labelled cases of `file` under tests/: (class, text).
fn cases(file: &str) -> Vec<(Class, String)> {
    let path = format!("{}/../../tests/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the labelled set under tests/");
    let root: Value = serde_json::from_str(&text).expect("the labelled set is JSON");
    root["cases"]
        .as_array()
        .expect("a cases array")
        .iter()
        .map(|c| {
            (
                Class::from_name(c["class"].as_str().unwrap()).expect("a known class"),
                c["text"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// (right, total, the confusion table as markdown) on `file`.
pub fn accuracy(file: &str) -> (usize, usize, String) {
    let cases = cases(file);
    let mut table = [[0usize; 4]; 4];
    for (want, text) in &cases {
        let got = classify(text).class;
        table[*want as usize][got as usize] += 1;
    }
    let right: usize = (0..4).map(|i| table[i][i]).sum();
    let mut md = String::from(
        "| want \\ got | code | prose | short | long_doc | right |\n|---|---|---|---|---|---|\n",
    );
    for want in Class::ALL {
        let row = &table[want as usize];
        let n: usize = row.iter().sum();
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {}/{} |\n",
            want.name(),
            row[0],
            row[1],
            row[2],
            row[3],
            row[want as usize],
            n
        ));
    }
    (right, cases.len(), md)
}

fn p50(mut ns: Vec<u128>) -> f64 {
    ns.sort_unstable();
    ns[ns.len() / 2] as f64 / 1000.0
}

#[test]
#[ignore = "prints figures; run by `cargo xtask laya-eval` in a release build"]
fn figures() {
    for file in [CASES, HOLDOUT, FRESH] {
        let (right, total, table) = accuracy(file);
        println!(
            "laya-eval: tests/{file}: accuracy {right}/{total} = {:.1}%",
            100.0 * right as f64 / total as f64
        );
        print!("{table}");
    }
    let policy = Policy::load(None).unwrap();
    let laya = Laya::new(policy, vec![("hrx".into(), 0)]);
    // The rules never wait, so the route's future is done at its first poll.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let cases = cases(CASES);
    let rounds = 20;
    let mut first = Vec::new();
    let mut later = Vec::new();
    for round in 0..rounds {
        for (i, (_, text)) in cases.iter().enumerate() {
            // A new conversation each time (its system message numbers it), then a later turn.
            let system = json!({"role": "system", "content": format!("conversation {round}-{i}")});
            let opening = json!({"messages": [system, {"role": "user", "content": text}]});
            let turn = json!({"messages": [system, {"role": "user", "content": text},
                {"role": "assistant", "content": "An answer."},
                {"role": "user", "content": "And another question?"}]});
            let (opening, turn) = (opening.to_string(), turn.to_string());
            let t = Instant::now();
            let a = runtime.block_on(laya.route(opening.as_bytes()));
            first.push(t.elapsed().as_nanos());
            let t = Instant::now();
            let b = runtime.block_on(laya.route(turn.as_bytes()));
            later.push(t.elapsed().as_nanos());
            assert_eq!(a.unwrap().header, b.unwrap().header);
        }
    }
    println!(
        "laya-eval: decision p50 over {} conversations: first turn {:.1} us, later turn {:.1} us",
        first.len(),
        p50(first),
        p50(later)
    );
}

#[test]
#[ignore = "lists the misses of each labelled set"]
fn misses() {
    for file in [CASES, HOLDOUT, FRESH] {
        for (want, text) in cases(file) {
            let got = classify(&text);
            if got.class != want {
                println!(
                    "{file}: want {} got {} {:.2}: {text}",
                    want.name(),
                    got.class.name(),
                    got.confidence
                );
            }
        }
    }
}
