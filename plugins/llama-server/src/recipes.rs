//! Recipes: tuned llama-server settings that depend on the model and the route, each with the
//! measurement behind it (`config/recipes.json`, or `--recipes FILE`), checked and applied to a
//! llama-server plan.
//!
//! ```json
//! {"recipes":[{"id":"...","match":{"device":["hrx"],"architecture":["qwen3"],"drafter":["none"],"moe":false},
//!              "args":["--flag","value"],"env":{"NAME":"value"},
//!              "why":"...","measured":"...","source":"..."}]}
//! ```
//!
//! A missing match key matches anything. `drafter` is the drafter serve runs: `mtp` (`--mtp`, or
//! the model's own MTP layers), `dflash` (`--dflash`), else `none`. A top-level `"about"` string says what the file is (the
//! original's own file has one). A flag group (a flag and the non-flag tokens after it) is
//! skipped when its flag is already on the command line, so serve's own settings and the first
//! recipe to set a flag win; an env entry is added only when neither the user nor the plan set it.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use onebit_plugin_api::{PlanRequest, Refusal};
use serde_json::Value;

use crate::options::Drafter;

/// The built-in set, and the name its errors give.
const BUILTIN: &str = include_str!("../../../config/recipes.json");
const BUILTIN_NAME: &str = "config/recipes.json";

const RECIPE_KEYS: [&str; 7] = ["id", "match", "args", "env", "why", "measured", "source"];
const MATCH_KEYS: [&str; 4] = ["device", "architecture", "drafter", "moe"];

/// One checked recipe.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recipe {
    pub id: String,
    pub devices: Option<Vec<String>>,
    pub architectures: Option<Vec<String>>,
    pub drafters: Option<Vec<String>>,
    pub moe: Option<bool>,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// A recipes file that cannot be used (`--recipes FILE`, or the built-in set): this crate's one
/// error type. Displayed as `<file>: <what is wrong>`, or `<file>: recipe <id>: <what is wrong>`
/// when one recipe is at fault (`#<n>` for one without an id), in one line; plan time refuses
/// it as a usage error, in one place (`From<RecipeError> for Refusal`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecipeError {
    file: String,
    recipe: Option<String>,
    problem: String,
}

impl RecipeError {
    /// About the file as a whole.
    fn in_file(file: &str, problem: impl Into<String>) -> RecipeError {
        RecipeError {
            file: file.to_string(),
            recipe: None,
            problem: problem.into(),
        }
    }

    /// About one recipe of the file.
    fn in_recipe(file: &str, recipe: &str, problem: impl Into<String>) -> RecipeError {
        RecipeError {
            file: file.to_string(),
            recipe: Some(recipe.to_string()),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for RecipeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.recipe {
            Some(id) => write!(f, "{}: recipe {id}: {}", self.file, self.problem),
            None => write!(f, "{}: {}", self.file, self.problem),
        }
    }
}

impl std::error::Error for RecipeError {}

/// Where the plugin ABI takes the error: a usage refusal (exit 2) carrying its line.
impl From<RecipeError> for Refusal {
    fn from(e: RecipeError) -> Refusal {
        Refusal::usage(e.to_string())
    }
}

/// Read and check a recipes file's text; `file` names it in errors.
pub fn parse(file: &str, text: &str) -> Result<Vec<Recipe>, RecipeError> {
    let doc: Value = serde_json::from_str(text)
        .map_err(|e| RecipeError::in_file(file, format!("not valid JSON: {e}")))?;
    let top = doc
        .as_object()
        .ok_or_else(|| RecipeError::in_file(file, "not a JSON object with a \"recipes\" list"))?;
    if let Some(key) = top.keys().find(|k| *k != "recipes" && *k != "about") {
        return Err(RecipeError::in_file(file, format!("unknown key \"{key}\"")));
    }
    if top.get("about").is_some_and(|a| !a.is_string()) {
        return Err(RecipeError::in_file(file, "\"about\" must be a string"));
    }
    let list = top
        .get("recipes")
        .and_then(Value::as_array)
        .ok_or_else(|| RecipeError::in_file(file, "no \"recipes\" list"))?;
    let mut seen = HashSet::new();
    let mut recipes = Vec::new();
    for (n, item) in list.iter().enumerate() {
        let recipe = check(file, item, n)?;
        if !seen.insert(recipe.id.clone()) {
            return Err(RecipeError::in_recipe(
                file,
                &recipe.id,
                "the id is listed twice",
            ));
        }
        recipes.push(recipe);
    }
    Ok(recipes)
}

/// A list of strings, or None when `value` is anything else.
fn strings(value: &Value) -> Option<Vec<String>> {
    value.as_array().and_then(|a| {
        a.iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
    })
}

fn not_strings(what: &str) -> String {
    format!("\"{what}\" must be a list of strings")
}

fn check(file: &str, item: &Value, n: usize) -> Result<Recipe, RecipeError> {
    let fallback = format!("#{}", n + 1);
    let Some(obj) = item.as_object() else {
        return Err(RecipeError::in_recipe(file, &fallback, "not a JSON object"));
    };
    let id = match obj.get("id").map(Value::as_str) {
        Some(Some(id)) if !id.is_empty() => id.to_string(),
        _ => {
            return Err(RecipeError::in_recipe(
                file,
                &fallback,
                "no \"id\" (a non-empty string)",
            ));
        }
    };
    let fail = |why: String| RecipeError::in_recipe(file, &id, why);
    if let Some(key) = obj.keys().find(|k| !RECIPE_KEYS.contains(&k.as_str())) {
        return Err(fail(format!("unknown key \"{key}\"")));
    }
    match obj.get("measured").map(Value::as_str) {
        Some(Some(m)) if !m.trim().is_empty() => {}
        _ => {
            return Err(fail(
                "no \"measured\": say which measurement the settings come from".to_string(),
            ));
        }
    }
    let mut recipe = Recipe {
        id: id.clone(),
        ..Default::default()
    };
    if let Some(m) = obj.get("match") {
        let m = m
            .as_object()
            .ok_or_else(|| fail("\"match\" must be an object".to_string()))?;
        if let Some(key) = m.keys().find(|k| !MATCH_KEYS.contains(&k.as_str())) {
            return Err(fail(format!("unknown match key \"{key}\"")));
        }
        let list = |key: &str| {
            m.get(key)
                .map(|v| strings(v).ok_or_else(|| fail(not_strings(&format!("match.{key}")))))
                .transpose()
        };
        recipe.devices = list("device")?;
        recipe.architectures = list("architecture")?;
        recipe.drafters = list("drafter")?;
        recipe.moe = match m.get("moe") {
            None => None,
            Some(v) => Some(
                v.as_bool()
                    .ok_or_else(|| fail("\"match.moe\" must be true or false".to_string()))?,
            ),
        };
    }
    if let Some(args) = obj.get("args") {
        recipe.args = strings(args).ok_or_else(|| fail(not_strings("args")))?;
        if let Some(first) = recipe.args.first().filter(|a| !is_flag(a)) {
            return Err(fail(format!(
                "\"args\" must start with a flag, not \"{first}\""
            )));
        }
    }
    if let Some(env) = obj.get("env") {
        let env = env
            .as_object()
            .ok_or_else(|| fail("\"env\" must be an object of strings".to_string()))?;
        for (k, v) in env {
            let v = v
                .as_str()
                .ok_or_else(|| fail(format!("env \"{k}\" must be a string")))?;
            recipe.env.insert(k.clone(), v.to_string());
        }
    }
    if recipe.args.is_empty() && recipe.env.is_empty() {
        return Err(fail(
            "adds nothing: give it \"args\" or \"env\"".to_string(),
        ));
    }
    Ok(recipe)
}

/// A flag: starts with `-` and is not a negative number.
fn is_flag(token: &str) -> bool {
    token.starts_with('-')
        && !token[1..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit() || c == '.')
}

/// The recipes this request asks for: none with `--no-recipes`, the file of `--recipes FILE`,
/// else the built-in set. A file that cannot be read or is malformed is a usage error.
pub fn selected(request: &PlanRequest) -> Result<Vec<Recipe>, Refusal> {
    let o = &request.options;
    if o.no_recipes {
        return Ok(Vec::new());
    }
    match &o.recipes {
        None => Ok(parse(BUILTIN_NAME, BUILTIN)?),
        Some(file) => {
            let text = std::fs::read_to_string(file).map_err(|e| {
                Refusal::usage(format!(
                    "--recipes {file}: {e}; pass a recipes JSON file, or --no-recipes"
                ))
            })?;
            Ok(parse(file, &text)?)
        }
    }
}

fn matches(recipe: &Recipe, request: &PlanRequest, device: &str, drafter: Drafter) -> bool {
    let has = |list: &Option<Vec<String>>, value: Option<&str>| {
        list.as_ref()
            .is_none_or(|l| value.is_some_and(|v| l.iter().any(|x| x == v)))
    };
    let moe = request.model.expert_count.is_some_and(|n| n > 1);
    has(&recipe.devices, Some(device))
        && has(&recipe.architectures, request.model.architecture.as_deref())
        && has(&recipe.drafters, Some(drafter.word()))
        && recipe.moe.is_none_or(|m| m == moe)
}

/// Apply the selected recipes that match to a llama-server plan's `argv` and `env`, for the
/// `drafter` the plan runs (`options::ModelArgs::drafter`); returns serve's lines,
/// `recipe <id>: <what it added>`, one per recipe that added something.
pub fn apply(
    request: &PlanRequest,
    device: &str,
    drafter: Drafter,
    argv: &mut Vec<String>,
    env: &mut BTreeMap<String, String>,
) -> Result<Vec<String>, Refusal> {
    let mut notes = Vec::new();
    for recipe in selected(request)?
        .iter()
        .filter(|r| matches(r, request, device, drafter))
    {
        let mut added = Vec::new();
        let mut groups: Vec<Vec<String>> = Vec::new();
        for token in &recipe.args {
            if is_flag(token) || groups.is_empty() {
                groups.push(vec![token.clone()]);
            } else if let Some(group) = groups.last_mut() {
                group.push(token.clone());
            }
        }
        for group in groups {
            if argv.iter().any(|a| *a == group[0]) {
                continue;
            }
            added.push(group.join(" "));
            argv.extend(group);
        }
        for (k, v) in &recipe.env {
            if crate::user_set(request, k) || env.contains_key(k) {
                continue;
            }
            added.push(format!("{k}={v}"));
            env.insert(k.clone(), v.clone());
        }
        if !added.is_empty() {
            notes.push(format!("recipe {}: {}", recipe.id, added.join(", ")));
        }
    }
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"recipes":[
        {"id":"ub","match":{"device":["hrx"],"architecture":["qwen3"]},"args":["-ub","1024","--cache-reuse","512","-ngl","0"],"env":{"A":"1","B":"2"},"why":"w","measured":"m","source":"s"},
        {"id":"second","args":["-ub","2048","--temp","-1"],"measured":"m"},
        {"id":"moe-only","match":{"moe":true},"args":["--flag-moe"],"measured":"m"}
    ]}"#;

    fn request(file: Option<&str>) -> PlanRequest {
        let mut r = PlanRequest::default();
        r.options.recipes = file.map(str::to_string);
        r.model.architecture = Some("qwen3".into());
        r.env.insert("B".into(), "user".into());
        r
    }

    #[test]
    fn the_built_in_set_is_valid() {
        assert!(parse(BUILTIN_NAME, BUILTIN).is_ok());
    }

    #[test]
    fn matching_recipes_add_groups_whose_flag_is_not_set_and_env_nobody_set() {
        let dir = std::env::temp_dir().join(format!("onebit-recipes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("r.json");
        std::fs::write(&file, GOOD).unwrap();
        let r = request(Some(file.to_str().unwrap()));
        let mut argv: Vec<String> = ["srv", "-ngl", "99"].map(String::from).to_vec();
        let mut env = BTreeMap::new();
        let notes = apply(&r, "hrx", Drafter::None, &mut argv, &mut env).unwrap();
        assert_eq!(
            argv.join(" "),
            "srv -ngl 99 -ub 1024 --cache-reuse 512 --temp -1"
        );
        assert_eq!(env, [("A".to_string(), "1".to_string())].into());
        assert_eq!(
            notes,
            [
                "recipe ub: -ub 1024, --cache-reuse 512, A=1",
                "recipe second: --temp -1"
            ]
        );
        let mut argv = vec!["srv".to_string()];
        let notes = apply(&r, "cpu", Drafter::None, &mut argv, &mut BTreeMap::new()).unwrap();
        assert_eq!(notes, ["recipe second: -ub 2048, --temp -1"]);
        let mut off = r.clone();
        off.options.no_recipes = true;
        assert!(
            apply(
                &off,
                "hrx",
                Drafter::None,
                &mut vec![],
                &mut BTreeMap::new()
            )
            .unwrap()
            .is_empty()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_recipe_matches_the_drafter_serve_runs() {
        let text = r#"{"about":"what this file is","recipes":[
            {"id":"plain","match":{"drafter":["none"]},"args":["--plain"],"measured":"m"},
            {"id":"mtp","match":{"drafter":["mtp"]},"args":["--for-mtp"],"measured":"m"},
            {"id":"dflash","match":{"drafter":["dflash"]},"args":["--for-dflash"],"measured":"m"}
        ]}"#;
        let dir = std::env::temp_dir().join(format!("onebit-drafters-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("r.json");
        std::fs::write(&file, text).unwrap();
        let applied = |drafter: Drafter| {
            let r = request(Some(file.to_str().unwrap()));
            let mut argv = Vec::new();
            apply(&r, "hrx", drafter, &mut argv, &mut BTreeMap::new()).unwrap();
            argv.join(" ")
        };
        assert_eq!(applied(Drafter::None), "--plain");
        assert_eq!(applied(Drafter::Mtp), "--for-mtp");
        assert_eq!(applied(Drafter::Dflash), "--for-dflash");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_malformed_file_is_refused_naming_the_file_the_recipe_and_the_key() {
        let cases = [
            (
                r#"{"recipes":[{"id":"bad","match":{"archtecture":["x"]},"args":["-a"],"measured":"m"}]}"#,
                r#"bad.json: recipe bad: unknown match key "archtecture""#,
            ),
            (
                r#"{"recipes":[{"id":"bad","args":["-a"],"measured":"m","mesured":"m"}]}"#,
                r#"bad.json: recipe bad: unknown key "mesured""#,
            ),
            (
                r#"{"recipes":[{"id":"bad","measured":"m"}]}"#,
                "bad.json: recipe bad: adds nothing",
            ),
            (
                r#"{"recipes":[{"id":"bad","args":["-a"]}]}"#,
                r#"bad.json: recipe bad: no "measured""#,
            ),
            (
                r#"{"recipes":[{"id":"bad","args":["-a"],"measured":"m"},{"id":"bad","args":["-b"],"measured":"m"}]}"#,
                "bad.json: recipe bad: the id is listed twice",
            ),
            (r#"{"recipe":[]}"#, r#"bad.json: unknown key "recipe""#),
            (
                r#"{"about":1,"recipes":[]}"#,
                r#"bad.json: "about" must be a string"#,
            ),
            (r#"{}"#, r#"bad.json: no "recipes" list"#),
            (
                r#"{"recipes":[{"id":"bad","args":["1024","-ub"],"measured":"m"}]}"#,
                r#"bad.json: recipe bad: "args" must start with a flag, not "1024""#,
            ),
            (
                r#"{"recipes":[{"args":["-a"],"measured":"m"}]}"#,
                r#"bad.json: recipe #1: no "id""#,
            ),
            ("{", "bad.json: not valid JSON"),
        ];
        for (text, expected) in cases {
            let err = parse("bad.json", text).unwrap_err().to_string();
            assert!(err.starts_with(expected), "{text}: {err}");
        }
    }
}
