//! The Project Manager's experts file (`config/pm-experts.json`, or `--pm-experts FILE`): read
//! and checked once at start, so a bad file is refused in one line naming the bad field.

use serde_json::{Map, Value};

use onebit_command::error::Fatal;

/// The built-in experts file, compiled into the binary.
pub const BUILT_IN: &str = include_str!("../../../../config/pm-experts.json");

/// Lemonade's chat route, when `pm.chat_path` does not name another.
const DEFAULT_CHAT_PATH: &str = "/api/v1/chat/completions";

/// One expert the PM can hand a task to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expert {
    /// The name the PM uses in `delegate(expert=…)`.
    pub expert: String,
    /// The model's Lemonade catalog id: what Lemonade is asked to run.
    pub id: String,
    pub domain: String,
    pub use_when: String,
    /// The expert's answer budget; 0 leaves it to Lemonade.
    pub max_tokens: u64,
}

/// The `pm` settings and the experts, as checked at start.
#[derive(Debug, Clone, PartialEq)]
pub struct Experts {
    pub max_rounds: u32,
    pub max_result_bytes: usize,
    pub delegate_timeout_s: u64,
    pub thinking: bool,
    /// Replaces the built-in prompt when set; the experts list is appended either way.
    pub system_prompt: Option<String>,
    pub chat_path: String,
    pub experts: Vec<Expert>,
}

impl Experts {
    /// Read `file` (or the built-in file for None) and check every field. Called once by serve's
    /// start, before any process starts; the error is the whole one-line refusal (exit 2).
    pub fn load(file: Option<&str>) -> Result<Experts, Fatal> {
        let (name, text) = match file {
            Some(path) => (
                format!("--pm-experts {path}"),
                std::fs::read_to_string(path).map_err(|e| {
                    Fatal::usage(format!(
                        "--pm-experts {path}: cannot read it ({e}); pass a readable JSON file"
                    ))
                })?,
            ),
            None => (
                "the built-in config/pm-experts.json".to_string(),
                BUILT_IN.to_string(),
            ),
        };
        Experts::parse(&text).map_err(|why| Fatal::usage(format!("{name}: {why}")))
    }

    /// The checks themselves, on the file's text; the error names the bad field.
    pub fn parse(text: &str) -> Result<Experts, String> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| format!("not JSON ({e}); see docs/pm.md for the format"))?;
        let root = root
            .as_object()
            .ok_or("expected an object with an \"experts\" array (docs/pm.md)")?;
        let empty = Map::new();
        let pm = match root.get("pm") {
            None => &empty,
            Some(Value::Object(pm)) => pm,
            Some(_) => return Err("\"pm\" must be an object".into()),
        };
        let max_rounds = whole(pm, "pm", "max_rounds", 4)?;
        if !(1..=64).contains(&max_rounds) {
            return Err(format!(
                "pm.max_rounds is {max_rounds}: it must be 1 to 64 (the last round offers no tools)"
            ));
        }
        let max_result_bytes = whole(pm, "pm", "max_result_bytes", 32768)?;
        if max_result_bytes < 1 {
            return Err("pm.max_result_bytes must be at least 1".into());
        }
        let delegate_timeout_s = whole(pm, "pm", "delegate_timeout_s", 1800)?;
        if delegate_timeout_s < 1 {
            return Err("pm.delegate_timeout_s must be at least 1 second".into());
        }
        let thinking = match pm.get("thinking") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("pm.thinking must be true or false".into()),
        };
        let system_prompt = optional_text(pm, "pm", "system_prompt")?;
        let chat_path =
            optional_text(pm, "pm", "chat_path")?.unwrap_or_else(|| DEFAULT_CHAT_PATH.to_string());
        if !chat_path.starts_with('/') {
            return Err(format!(
                "pm.chat_path {chat_path:?} must be a path starting with /, such as {DEFAULT_CHAT_PATH}"
            ));
        }
        let list = match root.get("experts") {
            Some(Value::Array(list)) => list,
            Some(_) => return Err("\"experts\" must be an array".into()),
            None => return Err("expected an object with an \"experts\" array (docs/pm.md)".into()),
        };
        let mut experts: Vec<Expert> = Vec::new();
        for (i, entry) in list.iter().enumerate() {
            let at = format!("experts[{i}]");
            let e = entry
                .as_object()
                .ok_or_else(|| format!("{at} must be an object"))?;
            let needed = |field: &str| -> Result<String, String> {
                match e.get(field) {
                    Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
                    _ => Err(format!(
                        "{at}.{field} is missing or empty: every expert needs \"expert\" and \"id\""
                    )),
                }
            };
            let expert = Expert {
                expert: needed("expert")?,
                id: needed("id")?,
                domain: optional_text(e, &at, "domain")?.unwrap_or_default(),
                use_when: optional_text(e, &at, "use_when")?.unwrap_or_default(),
                max_tokens: whole(e, &at, "max_tokens", 0)?,
            };
            if experts.iter().any(|x| x.expert == expert.expert) {
                return Err(format!(
                    "{at}.expert: expert \"{}\" is listed twice",
                    expert.expert
                ));
            }
            experts.push(expert);
        }
        Ok(Experts {
            max_rounds: max_rounds as u32,
            max_result_bytes: max_result_bytes as usize,
            delegate_timeout_s,
            thinking,
            system_prompt,
            chat_path,
            experts,
        })
    }

    /// The expert of this name, if any.
    pub fn find(&self, name: &str) -> Option<&Expert> {
        self.experts.iter().find(|e| e.expert == name)
    }

    /// The names, comma-separated, for the tool schema and the failure notes.
    pub fn names(&self) -> String {
        let names: Vec<&str> = self.experts.iter().map(|e| e.expert.as_str()).collect();
        if names.is_empty() {
            "(none)".to_string()
        } else {
            names.join(", ")
        }
    }

    /// The list the PM reads: in its prompt and as `experts()`'s result.
    pub fn listing(&self) -> String {
        if self.experts.is_empty() {
            return "(no experts configured: answer everything yourself)\n".to_string();
        }
        self.experts
            .iter()
            .map(|e| {
                format!(
                    "- {} ({}): {}. Use when: {}\n",
                    e.expert, e.id, e.domain, e.use_when
                )
            })
            .collect()
    }
}

/// A whole number field, `default` when absent.
fn whole(object: &Map<String, Value>, at: &str, field: &str, default: u64) -> Result<u64, String> {
    match object.get(field) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("{at}.{field} must be a whole number, not {v}")),
    }
}

/// A text field, None when absent.
fn optional_text(
    object: &Map<String, Value>,
    at: &str,
    field: &str,
) -> Result<Option<String>, String> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(format!("{at}.{field} must be text, not {v}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_file_has_the_four_default_experts() {
        let e = Experts::load(None).unwrap();
        let names: Vec<(&str, &str, u64)> = e
            .experts
            .iter()
            .map(|x| (x.expert.as_str(), x.id.as_str(), x.max_tokens))
            .collect();
        assert_eq!(
            names,
            [
                ("code", "Qwen2.5-Coder-7B-Instruct-1bit", 4096),
                ("code-heavy", "Qwen3-Coder-30B-A3B-Instruct-1bit", 8192),
                ("reasoning", "Qwen3.8-27B-1bit", 8192),
                ("agentic", "gpt-oss-20b-mxfp4-1bit", 4096),
            ]
        );
        assert_eq!(
            (
                e.max_rounds,
                e.max_result_bytes,
                e.delegate_timeout_s,
                e.thinking
            ),
            (4, 32768, 1800, false)
        );
        assert_eq!(e.chat_path, "/api/v1/chat/completions");
    }

    #[test]
    fn each_bad_field_is_named() {
        for (text, named) in [
            (r#"{"experts": [{"expert": "code"}]}"#, "experts[0].id"),
            (r#"{"experts": [{"id": "x"}]}"#, "experts[0].expert"),
            (
                r#"{"experts": [{"expert": "a", "id": "x", "max_tokens": -1}]}"#,
                "experts[0].max_tokens",
            ),
            (
                r#"{"pm": {"max_rounds": 0}, "experts": []}"#,
                "pm.max_rounds",
            ),
            (
                r#"{"pm": {"thinking": "no"}, "experts": []}"#,
                "pm.thinking",
            ),
            (
                r#"{"pm": {"chat_path": "api"}, "experts": []}"#,
                "pm.chat_path",
            ),
            (
                r#"{"pm": {"delegate_timeout_s": 0}, "experts": []}"#,
                "pm.delegate_timeout_s",
            ),
            (r#"{"experts": {}}"#, "\"experts\""),
            (
                r#"{"experts": [{"expert": "a", "id": "x"}, {"expert": "a", "id": "y"}]}"#,
                "experts[1].expert",
            ),
        ] {
            let why = Experts::parse(text).unwrap_err();
            assert!(why.contains(named), "{text}: {why}");
            assert!(!why.contains('\n'), "{why}");
        }
    }
}
