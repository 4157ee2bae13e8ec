//! The route's request table, looked up per request: the first rule, in the plan's order,
//! whose method matches (any case) and whose path is the request's or, for a path ending in
//! `*`, a prefix of it. A llama-server route has some sixty rules, so the rules with an exact
//! path are found through a map instead of a scan; the few prefix rules are scanned.

use std::collections::HashMap;

use onebit_plugin_api::Rule;

/// The plan's rules, indexed.
pub struct RuleTable {
    rules: Vec<Rule>,
    /// Exact path → the indices of its rules, in the plan's order.
    exact: HashMap<String, Vec<usize>>,
    /// The prefix rules (path ending in `*`): index and prefix, in the plan's order.
    prefixes: Vec<(usize, String)>,
}

impl RuleTable {
    pub fn new(rules: Vec<Rule>) -> RuleTable {
        let mut exact: HashMap<String, Vec<usize>> = HashMap::new();
        let mut prefixes = Vec::new();
        for (i, rule) in rules.iter().enumerate() {
            match rule.path.strip_suffix('*') {
                Some(prefix) => prefixes.push((i, prefix.to_string())),
                None => exact.entry(rule.path.clone()).or_default().push(i),
            }
        }
        RuleTable {
            rules,
            exact,
            prefixes,
        }
    }

    /// Every rule, in the plan's order.
    pub fn all(&self) -> &[Rule] {
        &self.rules
    }

    /// The first rule in the plan's order for `method` and `path`. Never blocks.
    pub fn find(&self, method: &str, path: &str) -> Option<&Rule> {
        let method_matches = |i: &usize| self.rules[*i].method.eq_ignore_ascii_case(method);
        let exact = self
            .exact
            .get(path)
            .and_then(|indices| indices.iter().copied().find(|i| method_matches(i)));
        let prefix = self
            .prefixes
            .iter()
            .take_while(|(i, _)| exact.is_none_or(|e| *i < e))
            .find(|(i, prefix)| path.starts_with(prefix.as_str()) && method_matches(i))
            .map(|(i, _)| *i);
        prefix.or(exact).map(|i| &self.rules[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::Action;

    fn rule(method: &str, path: &str, backend: usize) -> Rule {
        Rule {
            method: method.to_string(),
            path: path.to_string(),
            action: Action::Proxy { backend },
            ..Default::default()
        }
    }

    /// The table answers as a scan of the plan's rules does, whatever the mix of exact and
    /// prefix rules and their order.
    #[test]
    fn the_first_rule_in_the_plans_order_wins_as_a_scan_finds_it() {
        let rules = vec![
            rule("GET", "/health", 0),
            rule("POST", "/slots/*", 1),
            rule("POST", "/slots/0", 2),
            rule("post", "/tokenize", 3),
            rule("GET", "/tokenize", 4),
            rule("POST", "/tokenize", 5),
            rule("GET", "/v1/*", 6),
            rule("GET", "/v1/models", 7),
            rule("*", "/any", 8),
        ];
        let table = RuleTable::new(rules.clone());
        let scan = |method: &str, path: &str| {
            rules.iter().find(|r| {
                r.method.eq_ignore_ascii_case(method)
                    && match r.path.strip_suffix('*') {
                        Some(prefix) => path.starts_with(prefix),
                        None => r.path == path,
                    }
            })
        };
        for method in ["GET", "POST", "post", "PUT", "*"] {
            for path in [
                "/health",
                "/slots/0",
                "/slots/1",
                "/slots/",
                "/tokenize",
                "/v1/models",
                "/v1/chat",
                "/v1",
                "/any",
                "/",
                "",
            ] {
                assert_eq!(
                    table.find(method, path),
                    scan(method, path),
                    "{method} {path}"
                );
            }
        }
        assert_eq!(table.all().len(), rules.len());
    }
}
