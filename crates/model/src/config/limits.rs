//! Bounds on what a configuration file may cost before it is parsed: its
//! size, and how deeply its flow collections (`[..]`, `{..}`) nest. The
//! YAML parser's time grows with the square of the flow nesting (40,000
//! levels took 9 s of CPU), so depth is checked by a linear scan first.

use super::ConfigError;

/// Largest configuration accepted, in bytes. 10,000 workloads with
/// services and policies take about 5 MiB.
pub const MAX_CONFIG_BYTES: usize = 16 << 20;

/// Deepest nesting of flow collections accepted (a policy's rules nest
/// three deep; nothing in the schema nests deeper than six).
pub const MAX_FLOW_DEPTH: usize = 64;

/// Checks `text` against the bounds; `origin` names it in errors.
pub fn check(text: &str, origin: &str) -> Result<(), ConfigError> {
    let bounded = |what: String| ConfigError::Bounds {
        origin: origin.to_owned(),
        what,
    };
    if text.len() > MAX_CONFIG_BYTES {
        return Err(bounded(format!(
            "{} bytes, more than the {MAX_CONFIG_BYTES} accepted",
            text.len()
        )));
    }
    if text
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        return Err(ConfigError::Empty {
            origin: origin.to_owned(),
        });
    }
    if let Some(line) = too_deep(text) {
        return Err(bounded(format!(
            "flow collections nest deeper than {MAX_FLOW_DEPTH} levels at line {line}"
        )));
    }
    Ok(())
}

/// The 1-based line where flow nesting first exceeds the bound, if it
/// does. A bracket only counts where a YAML node may start (after a line
/// start, `:`, `,`, `-`, `?` or another opening bracket, spaces aside),
/// outside quoted scalars and comments; so `name: a[b` counts nothing.
fn too_deep(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut line = 1;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut comment = false;
    // The last character that was not a space, on this line.
    let mut before = '\n';
    for c in text.chars() {
        if c == '\n' {
            line += 1;
            comment = false;
            before = '\n';
            continue;
        }
        if comment {
            continue;
        }
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if q == '"' && c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            before = c;
            continue;
        }
        match c {
            ' ' | '\t' => continue,
            '#' => comment = true,
            '\'' | '"' if matches!(before, '\n' | ':' | ',' | '-' | '?' | '[' | '{') => {
                quote = Some(c);
            }
            '[' | '{' if matches!(before, '\n' | ':' | ',' | '-' | '?' | '[' | '{') => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some(line);
                }
            }
            ']' | '}' => depth = depth.saturating_sub(1),
            // Inside a plain scalar: what follows is scalar text too.
            '[' | '{' => {
                before = 'a';
                continue;
            }
            _ => {}
        }
        before = c;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_flow_nesting_is_refused_with_its_line() {
        let deep = format!("workloads:\n- {}{}\n", "[".repeat(65), "]".repeat(65));
        let err = check(&deep, "f.yaml")
            .map(drop)
            .expect_err("must be refused")
            .to_string();
        assert!(err.contains("deeper than 64 levels at line 2"), "{err}");
        let fine = format!("workloads: {}{}\n", "[".repeat(64), "]".repeat(64));
        assert!(check(&fine, "f.yaml").is_ok());
    }

    #[test]
    fn brackets_in_scalars_quotes_and_comments_do_not_count() {
        let text = format!(
            "workloads: []\n# {}\nname: a{}\nother: '{}'\nthird: \"\\\"{}\"\n",
            "[".repeat(100),
            "[".repeat(100),
            "[".repeat(100),
            "[".repeat(100)
        );
        assert!(check(&text, "f.yaml").is_ok());
    }

    #[test]
    fn empty_and_comment_only_files_are_refused() {
        for text in ["", "\n  \n", "# nothing here\n\n"] {
            let err = check(text, "f.yaml")
                .map(drop)
                .expect_err("must be refused");
            assert!(matches!(err, ConfigError::Empty { .. }), "{err}");
        }
    }

    #[test]
    fn oversized_files_are_refused_before_parsing() {
        let text = "#".repeat(MAX_CONFIG_BYTES + 1);
        let err = check(&text, "f.yaml")
            .map(drop)
            .expect_err("must be refused")
            .to_string();
        assert!(err.contains("more than the"), "{err}");
    }
}
