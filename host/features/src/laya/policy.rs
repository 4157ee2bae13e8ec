//! The route policy (`config/route-policy.json`, or `--route-policy FILE`): which device each
//! class of conversation runs on, read and checked once at start.

use std::collections::BTreeMap;

use serde_json::Value;

use super::classify::{Class, Decision};
use onebit_command::error::Fatal;

/// The built-in policy, compiled into the binary.
pub const BUILT_IN: &str = include_str!("../../../../config/route-policy.json");

/// Class → device, with the confidence below which a class takes the default.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub min_confidence: f64,
    pub default: String,
    /// A class's device and why; a class not listed takes the default.
    pub classes: BTreeMap<Class, (String, String)>,
}

impl Policy {
    /// Read `file` (the built-in policy for None) and check it; the error is the one-line
    /// refusal (exit 2). Called once by serve's start.
    pub fn load(file: Option<&str>) -> Result<Policy, Fatal> {
        let (text, whence) = match file {
            Some(path) => (
                std::fs::read_to_string(path).map_err(|e| {
                    Fatal::usage(format!(
                        "route policy: cannot read {path} ({e}); pass a readable JSON file to --route-policy, or leave it out for the built-in policy"
                    ))
                })?,
                format!(" in {path}"),
            ),
            None => (BUILT_IN.to_string(), " (built-in)".to_string()),
        };
        Policy::parse(&text).map_err(|why| Fatal::usage(format!("route policy: {why}{whence}")))
    }

    pub fn parse(text: &str) -> Result<Policy, String> {
        let root: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
        let Some(classes) = root.get("classes").and_then(Value::as_object) else {
            return Err("needs a \"classes\" object".into());
        };
        let min_confidence = match root.get("min_confidence") {
            None => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|c| (0.0..=1.0).contains(c))
                .ok_or_else(|| {
                    format!("\"min_confidence\" must be a number from 0 to 1, not {v}")
                })?,
        };
        let default = match root.get("default") {
            None => "hrx".to_string(),
            Some(Value::String(d)) if !d.trim().is_empty() => d.clone(),
            Some(v) => return Err(format!("\"default\" must name a device, not {v}")),
        };
        let mut rows = BTreeMap::new();
        for (name, row) in classes {
            let class = Class::from_name(name).ok_or_else(|| {
                format!("unknown class \"{name}\" (the classes are code, prose, short, long_doc)")
            })?;
            let Some(device) = row
                .get("device")
                .and_then(Value::as_str)
                .filter(|d| !d.trim().is_empty())
            else {
                return Err(format!("class \"{name}\" needs a \"device\""));
            };
            let why = row.get("why").and_then(Value::as_str).unwrap_or("");
            rows.insert(class, (device.to_string(), why.to_string()));
        }
        Ok(Policy {
            min_confidence,
            default,
            classes: rows,
        })
    }

    /// Every device the policy can pick, the default first, each once.
    pub fn devices(&self) -> Vec<String> {
        let mut out = vec![self.default.clone()];
        for (device, _) in self.classes.values() {
            if !out.contains(device) {
                out.push(device.clone());
            }
        }
        out
    }

    /// The device for a decision among the devices that run (`running`, the fallback first):
    /// the class's row when sure enough and its device runs, else the default when it runs,
    /// else the first that runs.
    pub fn pick<'a>(&self, decision: &Decision, running: &'a [String]) -> Option<&'a str> {
        let find = |d: &str| running.iter().find(|r| *r == d).map(String::as_str);
        if decision.confidence >= self.min_confidence
            && let Some((device, _)) = self.classes.get(&decision.class)
            && let Some(found) = find(device)
        {
            return Some(found);
        }
        find(&self.default).or(running.first().map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_policy_sends_every_class_to_hrx() {
        let p = Policy::load(None).unwrap();
        assert_eq!(p.default, "hrx");
        assert_eq!(p.min_confidence, 0.16);
        assert_eq!(p.classes.len(), 4);
        assert_eq!(p.devices(), ["hrx"]);
    }

    #[test]
    fn picks_fall_back_to_the_default_then_the_first_that_runs() {
        let p = Policy::parse(
            r#"{"min_confidence": 0.5, "default": "cpu", "classes": {
                "code": {"device": "hrx"}, "prose": {"device": "npu"}}}"#,
        )
        .unwrap();
        let running = vec!["cpu".to_string(), "hrx".to_string()];
        let d = |class, confidence| Decision { class, confidence };
        assert_eq!(p.pick(&d(Class::Code, 0.9), &running), Some("hrx"));
        assert_eq!(
            p.pick(&d(Class::Code, 0.4), &running),
            Some("cpu"),
            "unsure"
        );
        assert_eq!(
            p.pick(&d(Class::Prose, 0.9), &running),
            Some("cpu"),
            "npu does not run"
        );
        assert_eq!(
            p.pick(&d(Class::Short, 0.9), &running),
            Some("cpu"),
            "no row"
        );
        let hrx_only = vec!["hrx".to_string()];
        assert_eq!(p.pick(&d(Class::Short, 0.9), &hrx_only), Some("hrx"));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        for (text, says) in [
            ("[]", "needs a \"classes\" object"),
            (
                r#"{"classes": {"poetry": {"device": "cpu"}}}"#,
                "unknown class \"poetry\"",
            ),
            (
                r#"{"classes": {"code": {"why": "x"}}}"#,
                "class \"code\" needs a \"device\"",
            ),
            (
                r#"{"min_confidence": 2, "classes": {}}"#,
                "\"min_confidence\" must be",
            ),
            (
                r#"{"default": 3, "classes": {}}"#,
                "\"default\" must name a device",
            ),
        ] {
            let why = Policy::parse(text).unwrap_err();
            assert!(why.contains(says), "{text}: {why}");
        }
    }
}
