//! The Laya daemon's protocol (ggmlc's `laya daemon`), one JSON object a line on its stdin and
//! stdout: it says `{"status": "ready", …}` once loaded; serve writes the text to classify as
//! the state with one `choice` question over `code`, `prose` and `short`; the daemon answers
//! the choice, its confidence and the probabilities (docs/laya.md).

use serde_json::Value;

use super::super::classify::{Class, Decision};

/// The question's key in the request and the answer.
const KEY: &str = "cls";
/// The question, and each class with its description, in the order asked: the wording the
/// original engine measured its 95.5% with (its `laya/route.cpp`, the default wording).
const INSTRUCTIONS: &str = "What kind of answer does this request need?";
pub const CRITERIA: [(Class, &str); 3] = [
    (
        Class::Code,
        "source code, a script, a fix to a program, or an explanation of code",
    ),
    (
        Class::Prose,
        "several paragraphs of explanation, writing, advice or a story",
    ),
    (Class::Short, "one word, one number or one sentence"),
];

/// The request line for `text`, newline included. Written by hand so that the classes keep
/// their order whatever serde_json's map does.
pub fn question(text: &str) -> String {
    let quote = |s: &str| Value::String(s.to_string()).to_string();
    let criteria: Vec<String> = CRITERIA
        .iter()
        .map(|(class, why)| format!("{}: {}", quote(class.name()), quote(why)))
        .collect();
    format!(
        "{{\"state\": {}, \"questions\": {{{}: {{\"type\": \"choice\", \"instructions\": {}, \"criteria\": {{{}}}}}}}}}\n",
        quote(text),
        quote(KEY),
        quote(INSTRUCTIONS),
        criteria.join(", ")
    )
}

/// A line the daemon printed before it was ready: Some(Ok) for its ready line, Some(Err) for
/// an error it reported, None for anything else (a banner, a log line), which is passed over.
pub fn ready(line: &str) -> Option<Result<(), String>> {
    let value: Value = serde_json::from_str(line.trim()).ok()?;
    if let Some(error) = value.get("error") {
        return Some(Err(format!("it reported {}", short(&error.to_string()))));
    }
    (value.get("status").and_then(Value::as_str) == Some("ready")).then_some(Ok(()))
}

/// The daemon's answer line as a decision; Err says what is wrong with it.
pub fn answer(line: &str) -> Result<Decision, String> {
    let not = |why: &str| Err(format!("{why}: {}", short(line.trim())));
    let Ok(value) = serde_json::from_str::<Value>(line.trim()) else {
        return not("not a JSON line");
    };
    if let Some(error) = value.get("error") {
        return Err(format!(
            "it answered an error: {}",
            short(&error.to_string())
        ));
    }
    let Some(answer) = value.get("answers").and_then(|a| a.get(KEY)) else {
        return not("no answers.cls");
    };
    let Some(class) = answer
        .get("choice")
        .and_then(Value::as_str)
        .and_then(|c| CRITERIA.iter().find(|(class, _)| class.name() == c))
        .map(|(class, _)| *class)
    else {
        return not("its choice is not one of code, prose, short");
    };
    let confidence = answer
        .get("confidence")
        .and_then(Value::as_f64)
        .or_else(|| {
            answer
                .get("probabilities")
                .and_then(|p| p.get(class.name()))
                .and_then(Value::as_f64)
        });
    match confidence {
        Some(c) if (0.0..=1.0).contains(&c) => Ok(Decision {
            class,
            confidence: c,
        }),
        _ => not("no confidence from 0 to 1"),
    }
}

/// At most 160 characters of what the daemon said, for a line.
fn short(text: &str) -> String {
    match text.char_indices().nth(160) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_question_is_the_state_and_three_classes_in_order() {
        let line = question("Say \"hi\"\nplease");
        assert!(line.ends_with("}\n") && line.matches('\n').count() == 1);
        let value: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["state"], "Say \"hi\"\nplease");
        let q = &value["questions"]["cls"];
        assert_eq!(q["type"], "choice");
        assert_eq!(q["instructions"], INSTRUCTIONS);
        let at = |k: &str| line.find(&format!("\"{k}\": ")).unwrap();
        assert!(
            at("criteria") < at("code") && at("code") < at("prose") && at("prose") < at("short")
        );
        assert_eq!(
            q["criteria"]["short"],
            "one word, one number or one sentence"
        );
    }

    #[test]
    fn ready_lines_and_answers_are_read_and_anything_else_is_said() {
        assert_eq!(
            ready(r#"{"status": "ready", "model": "laya"}"#),
            Some(Ok(()))
        );
        assert_eq!(ready("loading weights..."), None);
        assert_eq!(ready(r#"{"status": "loading"}"#), None);
        assert!(ready(r#"{"error": "no such file"}"#).unwrap().is_err());

        let ok = r#"{"answers": {"cls": {"type": "choice", "choice": "prose", "confidence": 0.73, "probabilities": {"code": 0.1, "prose": 0.73, "short": 0.17}}}, "id": 1}"#;
        assert_eq!(
            answer(ok),
            Ok(Decision {
                class: Class::Prose,
                confidence: 0.73
            })
        );
        let no_confidence =
            r#"{"answers": {"cls": {"choice": "code", "probabilities": {"code": 0.9}}}}"#;
        assert_eq!(answer(no_confidence).unwrap().confidence, 0.9);
        for (line, says) in [
            ("garbage", "not a JSON line: garbage"),
            (
                r#"{"id": 1, "error": "missing questions"}"#,
                "answered an error",
            ),
            (r#"{"answers": {}}"#, "no answers.cls"),
            (
                r#"{"answers": {"cls": {"choice": "long_doc", "confidence": 1}}}"#,
                "not one of",
            ),
            (
                r#"{"answers": {"cls": {"choice": "code", "confidence": 7}}}"#,
                "no confidence",
            ),
        ] {
            let why = answer(line).unwrap_err();
            assert!(why.contains(says), "{line}: {why}");
        }
        assert!(answer(&"x".repeat(500)).unwrap_err().chars().count() < 200);
    }
}
