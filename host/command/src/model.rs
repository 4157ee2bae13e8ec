//! What serve knows about the model before planning: its files, size, GGUF facts, served name.

use std::path::Path;

use onebit_plugin_api::ModelFacts;

use crate::error::Fatal;

/// The served name: `--alias`, else the model file's stem (a directory's own name).
pub fn served_name(model: &Path, alias: Option<&str>) -> String {
    if let Some(first) = names(alias).into_iter().next() {
        return first;
    }
    let name = if model.is_dir() {
        model.file_name()
    } else {
        model.file_stem()
    };
    name.map(|n| n.to_string_lossy().into_owned())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "model".to_string())
}

/// The names of a comma-separated `--alias` (or `--tags`), as llama-server reads them: each
/// trimmed, the empty ones dropped, sorted and without repeats (its `std::set`). The first is
/// the served name.
pub fn names(list: Option<&str>) -> Vec<String> {
    let set: std::collections::BTreeSet<String> = list
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect();
    set.into_iter().collect()
}

/// Read what the plan needs from the model: its files and size, and for a GGUF its
/// architecture and training context. A file that is not a GGUF (or an empty one) is not
/// refused here: its facts say why they are missing, and the route decides.
pub fn facts(model: &Path) -> Result<ModelFacts, Fatal> {
    let meta = std::fs::metadata(model).map_err(|e| {
        Fatal::usage(format!(
            "-m {}: {}; pass a .gguf file or a model directory",
            model.display(),
            io_reason(&e)
        ))
    })?;
    let path = model.to_string_lossy().into_owned();
    if meta.is_dir() {
        return Ok(ModelFacts {
            path: path.clone(),
            is_dir: true,
            files: vec![path],
            ..Default::default()
        });
    }
    let mut facts = ModelFacts {
        path: path.clone(),
        files: vec![path],
        bytes: meta.len(),
        ..Default::default()
    };
    if meta.len() == 0 {
        facts.gguf_error = Some(format!("{}: the file is empty", model.display()));
        return Ok(facts);
    }
    match gguf::read_header_lean(model) {
        Ok(header) => {
            facts.architecture = header.architecture().map(str::to_string);
            facts.expert_count = header
                .arch_key("expert_count")
                .and_then(|k| header.get_u64(&k));
            facts.hadamard_q4_0 = header.get("onebit.hadamard_q4_0").is_some();
            facts.context_length = header
                .arch_key("context_length")
                .and_then(|k| header.get_u64(&k));
            match gguf::model_files(model) {
                Ok(files) => {
                    facts.bytes = files
                        .iter()
                        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
                        .sum();
                    facts.files = files
                        .iter()
                        .map(|f| f.to_string_lossy().into_owned())
                        .collect();
                }
                Err(e) => return Err(Fatal::usage(e.to_string())),
            }
        }
        Err(e) => facts.gguf_error = Some(e.to_string()),
    }
    Ok(facts)
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file or directory".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_name_is_the_alias_else_the_stem() {
        let p = Path::new("/models/SmolLM2-135M-Instruct-Q4_1.gguf");
        assert_eq!(served_name(p, Some("smol")), "smol");
        assert_eq!(served_name(p, None), "SmolLM2-135M-Instruct-Q4_1");
        // A list, as llama-server's -a: trimmed, sorted, the first is the name.
        assert_eq!(served_name(p, Some("tinyllama-2, fim,code")), "code");
        assert_eq!(names(Some(" b,a,,b ")), ["a", "b"]);
        assert_eq!(served_name(p, Some(" , ")), "SmolLM2-135M-Instruct-Q4_1");
    }

    #[test]
    fn a_missing_model_is_a_usage_error_and_an_empty_file_is_not_refused() {
        let e = facts(Path::new("/nonexistent/x.gguf")).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.message.contains("no such file"), "{}", e.message);
        let dir = std::env::temp_dir().join(format!("onebit-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.gguf");
        std::fs::write(&empty, b"").unwrap();
        let f = facts(&empty).unwrap();
        assert!(f.architecture.is_none() && f.gguf_error.is_some());
        let text = dir.join("text.gguf");
        std::fs::write(&text, b"hello, not a gguf").unwrap();
        let f = facts(&text).unwrap();
        assert!(f.gguf_error.unwrap().contains("GGUF"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
