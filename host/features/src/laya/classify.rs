//! The rule-based request classifier of `--laya`: a size gate for long documents, then keyword
//! and shape rules scoring code, prose and short answers. It stands in for the Laya model
//! (a ModernBERT scorer), which this engine does not run (docs/laya.md).

/// A request of this many characters or more is a long document, without any other rule.
pub const LONG_DOC_CHARS: usize = 1024;

/// What a conversation is about, as the route policy names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Code,
    Prose,
    Short,
    LongDoc,
}

impl Class {
    pub const ALL: [Class; 4] = [Class::Code, Class::Prose, Class::Short, Class::LongDoc];

    /// The name the policy file and the `X-1bit-Route` header use.
    pub fn name(self) -> &'static str {
        match self {
            Class::Code => "code",
            Class::Prose => "prose",
            Class::Short => "short",
            Class::LongDoc => "long_doc",
        }
    }

    pub fn from_name(name: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// A class with how sure the rules are: the softmax share of the winning score (1.0 for the
/// size gate; 1/3 when no rule fired at all).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub class: Class,
    pub confidence: f64,
}

/// Symbols that appear in code and hardly ever in chat (weight 3 each).
const CODE_SYMBOLS: [&str; 16] = [
    "```", "`", "#include", "=>", "();", "::", "!=", "==", "->", "{", "}", "def ", "fn ",
    "import ", "println", "console.",
];
/// Languages, tools and formats (weight 3 each, whole words).
const CODE_NAMES: [&str; 58] = [
    "rust",
    "python",
    "javascript",
    "typescript",
    "java",
    "kotlin",
    "golang",
    "go",
    "c",
    "c++",
    "c#",
    "sql",
    "postgresql",
    "mysql",
    "sqlite",
    "bash",
    "shell",
    "dockerfile",
    "docker",
    "makefile",
    "cmake",
    "regex",
    "react",
    "vue",
    "angular",
    "node.js",
    "pandas",
    "numpy",
    "flask",
    "django",
    "jest",
    "html",
    "css",
    "json",
    "yaml",
    "xml",
    "csv",
    "git",
    "github",
    "cargo",
    "npm",
    "pip",
    "pytest",
    "api",
    "compiler",
    "gcc",
    "clang",
    "valgrind",
    "curl",
    "linux",
    "kubernetes",
    "powershell",
    "swift",
    "php",
    "ruby",
    "haskell",
    "lua",
    "perl",
];
/// Programming words (weight 2 each, whole words).
const CODE_WORDS: [&str; 77] = [
    "function",
    "functions",
    "class",
    "method",
    "variable",
    "loop",
    "array",
    "list comprehension",
    "pointer",
    "compile",
    "build",
    "bug",
    "debug",
    "script",
    "query",
    "implement",
    "refactor",
    "algorithm",
    "complexity",
    "unit test",
    "test",
    "tests",
    "endpoint",
    "http",
    "thread",
    "thread-safe",
    "hashmap",
    "interface",
    "data class",
    "struct",
    "structs",
    "binary search",
    "linked list",
    "syntax",
    "code",
    "error",
    "exception",
    "segfault",
    "stack trace",
    "profile",
    "dataframe",
    "commit",
    "commits",
    "repository",
    "repo",
    "parse",
    "parses",
    "typeerror",
    "vector",
    "string",
    "strings",
    "integer",
    "integers",
    "program",
    "div",
    "queue",
    "queues",
    "stack",
    "closure",
    "recursion",
    "recursive",
    "linking",
    "linker",
    "mock",
    "undefined",
    "runtime",
    "database",
    "schema",
    "server",
    "library",
    "package",
    "module",
    "dependency",
    "terminal",
    "command line",
    "deploy",
    "null",
];
/// Asking for writing (weight 2 each, whole words).
const PROSE_VERBS: [&str; 11] = [
    "write a",
    "write an",
    "write the",
    "draft",
    "compose",
    "rewrite",
    "tell me a",
    "summarise",
    "summarize",
    "translate this text",
    "retell",
];
/// Asking for an account (weight 2.5 each, whole words).
const PROSE_ACCOUNTS: [&str; 4] = ["explain", "describe", "discuss", "what life was like"];
/// Kinds of writing (weight 2.5 each, whole words).
const PROSE_KINDS: [&str; 38] = [
    "story",
    "poem",
    "essay",
    "letter",
    "email",
    "speech",
    "toast",
    "eulogy",
    "blog",
    "post",
    "paragraph",
    "paragraphs",
    "review",
    "description",
    "novel",
    "song",
    "chorus",
    "note",
    "cover letter",
    "introduction",
    "article",
    "recommendation",
    "plot",
    "lyrics",
    "haiku",
    "persuasive",
    "announcement",
    "limerick",
    "message",
    "diary",
    "biography",
    "fairy tale",
    "op-ed",
    "apology",
    "farewell",
    "tribute",
    "anecdote",
    "slogan",
];
/// Asking to make something: not a short question (takes 2 from short, whole words).
const MAKING: [&str; 12] = [
    "write",
    "generate",
    "implement",
    "create",
    "show me",
    "build",
    "make",
    "compose",
    "draft",
    "give me a heartfelt",
    "give me an example",
    "rewrite",
];
/// How a short question starts (weight 2, at the start).
const SHORT_OPENINGS: [&str; 21] = [
    "what is",
    "what's",
    "what does",
    "what year",
    "what time",
    "who",
    "when",
    "where",
    "which",
    "how many",
    "how far",
    "how much",
    "how old",
    "is ",
    "are ",
    "can ",
    "does ",
    "spell",
    "define",
    "translate",
    "give me a synonym",
];
/// Greetings and thanks (weight 3, the whole message).
const SHORT_SMALL_TALK: [&str; 9] = [
    "hi",
    "hello",
    "hey",
    "thanks",
    "thank you",
    "good morning",
    "good night",
    "ok",
    "bye",
];

/// Classify the text that opens a conversation. Pure and quick (microseconds); called by the
/// relay on the request's task, once per conversation.
pub fn classify(text: &str) -> Decision {
    if text.chars().count() >= LONG_DOC_CHARS {
        return Decision {
            class: Class::LongDoc,
            confidence: 1.0,
        };
    }
    let lower = text.to_lowercase();
    let words = lower.split_whitespace().count();

    let mut code = 0.0;
    code += 3.0 * CODE_SYMBOLS.iter().filter(|s| lower.contains(*s)).count() as f64;
    code += 3.0 * count_words(&lower, &CODE_NAMES);
    code += 2.0 * count_words(&lower, &CODE_WORDS);

    let mut prose = 0.0;
    prose += 2.0 * count_words(&lower, &PROSE_VERBS);
    prose += 2.5 * count_words(&lower, &PROSE_ACCOUNTS);
    prose += 2.5 * count_words(&lower, &PROSE_KINDS);

    let mut short: f64 = match words {
        0..=6 => 3.0,
        7..=10 => 2.0,
        11..=14 => 1.0,
        _ => 0.0,
    };
    let trimmed = lower.trim();
    if SHORT_OPENINGS.iter().any(|o| trimmed.starts_with(o)) {
        short += 2.0;
    }
    if trimmed.ends_with('?') {
        short += 1.0;
    }
    if count_words(&lower, &MAKING) > 0.0 {
        short -= 2.0;
    }
    let bare = trimmed.trim_end_matches(['!', '.', '?', ' ']);
    if SHORT_SMALL_TALK.contains(&bare) {
        short += 3.0;
    }

    let scores = [
        (Class::Code, code),
        (Class::Prose, prose),
        (Class::Short, short),
    ];
    let (class, top) = scores
        .iter()
        .copied()
        .fold((Class::Short, f64::MIN), |best, (c, s)| {
            if s > best.1 { (c, s) } else { best }
        });
    let total: f64 = scores.iter().map(|(_, s)| (s - top).exp()).sum();
    Decision {
        class,
        confidence: 1.0 / total,
    }
}

/// How many of `phrases` occur in `text` as whole words (no letter or digit either side).
fn count_words(text: &str, phrases: &[&str]) -> f64 {
    phrases.iter().filter(|p| has_word(text, p)).count() as f64
}

fn has_word(text: &str, phrase: &str) -> bool {
    let bytes = text.as_bytes();
    let mut from = 0;
    while let Some(at) = text[from..].find(phrase) {
        let start = from + at;
        let end = start + phrase.len();
        let before = start == 0 || !bytes[start - 1].is_ascii_alphanumeric();
        let after = end == bytes.len() || !bytes[end].is_ascii_alphanumeric();
        if before && after {
            return true;
        }
        from = start + 1;
        while !text.is_char_boundary(from) {
            from += 1;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(text: &str) -> &'static str {
        classify(text).class.name()
    }

    #[test]
    fn the_size_gate_and_each_class() {
        let long = "word ".repeat(205);
        assert_eq!(
            classify(&long),
            Decision {
                class: Class::LongDoc,
                confidence: 1.0
            }
        );
        assert_eq!(class(&"x".repeat(1023)), "short");
        assert_eq!(class("Write a Rust function that sums a slice."), "code");
        assert_eq!(class("Write a poem about the sea at night."), "prose");
        assert_eq!(class("What is the capital of France?"), "short");
        let d = classify("Write a Rust function that sums a slice.");
        assert!(d.confidence > 0.5 && d.confidence <= 1.0, "{d:?}");
    }

    #[test]
    fn whole_words_only() {
        assert!(has_word("in go and rust", "go"));
        assert!(!has_word("a good cargo", "go"));
        assert!(!has_word("the capital", "api"));
        assert!(has_word("über api", "api"));
    }

    /// The labelled set (tests/laya_cases.json): the accuracy docs/laya.md reports, kept from
    /// slipping.
    #[test]
    fn the_labelled_set_is_at_least_ninety_percent_right() {
        let (right, total, _) = super::super::eval::accuracy("laya_cases.json");
        assert_eq!(total, 100);
        assert!(right >= 90, "{right}/{total}");
    }
}
