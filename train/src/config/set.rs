//! `--set a.b=v`: overrides of any key of a TOML document, applied before it is parsed, so
//! an override goes through the same validation as the file.

use toml::{Table, Value};

use super::ConfigError;

/// Parses `v` as a TOML value (`3`, `1e-4`, `true`, `"x"`, `["vision"]`); anything that is
/// not a TOML literal is taken as a bare string (`run.dir=runs/x`).
fn parse_value(v: &str) -> Value {
    let doc = format!("v = {v}");
    match doc.parse::<Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| Value::String(v.to_string())),
        Err(_) => Value::String(v.to_string()),
    }
}

/// Applies one `KEY=VALUE` override to `doc`: intermediate tables are created as needed;
/// setting a key inside something that is not a table is an error naming both.
pub fn apply_set(doc: &mut Table, assignment: &str) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError::Set {
        assignment: assignment.to_string(),
        reason,
    };
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| bad("expected KEY=VALUE, e.g. `--set train.steps=100`".into()))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if key.is_empty() || parts.iter().any(|p| p.is_empty()) {
        return Err(bad(format!("`{key}` is not a dotted key like `optim.lr`")));
    }
    let (last, path) = parts.split_last().ok_or_else(|| bad("empty key".into()))?;
    let mut table = doc;
    for (i, p) in path.iter().enumerate() {
        let entry = table
            .entry(p.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        table = match entry {
            Value::Table(t) => t,
            other => {
                return Err(bad(format!(
                    "`{}` is a {}, not a table",
                    parts[..=i].join("."),
                    other.type_str()
                )));
            }
        };
    }
    table.insert(last.to_string(), parse_value(value.trim()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_as_toml_or_fall_back_to_strings() {
        let mut doc: Table = "[train]\nsteps = 10\n".parse().unwrap();
        apply_set(&mut doc, "train.steps=25").unwrap();
        apply_set(&mut doc, "optim.lr=1e-3").unwrap();
        apply_set(&mut doc, "train.freeze=[\"vision\"]").unwrap();
        apply_set(&mut doc, "run.dir=runs/x").unwrap();
        assert_eq!(doc["train"]["steps"].as_integer(), Some(25));
        assert_eq!(doc["optim"]["lr"].as_float(), Some(1e-3));
        assert_eq!(doc["train"]["freeze"][0].as_str(), Some("vision"));
        assert_eq!(doc["run"]["dir"].as_str(), Some("runs/x"));
    }

    #[test]
    fn malformed_assignments_are_errors() {
        let mut doc: Table = "[train]\nsteps = 10\n".parse().unwrap();
        for bad in ["train.steps", "=3", "a..b=1", "train.steps.x=1"] {
            let e = apply_set(&mut doc, bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
