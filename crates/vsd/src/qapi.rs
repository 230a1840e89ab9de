//! QMP arguments read into a command's struct, with the errors in QEMU's
//! words (its QAPI input visitor's): `Parameter 'sync' is missing`, `...
//! is unexpected`, `... does not accept value 'x'`, `Invalid parameter
//! type for 'speed', expected: integer`, each naming the member by its
//! path (`actions[0].data.sync`).

use serde::de::DeserializeOwned;
use serde_json::Value;
use vsd_control::qmp::QmpError;

/// `args` as a `T`; unknown, missing or mistyped members are errors.
pub(crate) fn parse<T: DeserializeOwned>(args: Value) -> Result<T, QmpError> {
    parse_member("", args)
}

/// As [`parse`], for the member of a command's arguments at `path`.
pub(crate) fn parse_member<T: DeserializeOwned>(path: &str, args: Value) -> Result<T, QmpError> {
    serde_path_to_error::deserialize(args).map_err(|e| {
        let inner = e.path().to_string();
        let full = match (path, inner.as_str()) {
            (_, ".") => path.to_string(),
            ("", inner) => inner.to_string(),
            (path, inner) if inner.starts_with('[') => format!("{path}{inner}"),
            (path, inner) => format!("{path}.{inner}"),
        };
        QmpError::generic(in_qemu_words(&full, &e.into_inner().to_string()))
    })
}

/// serde_json's complaint about the member at `path` as QEMU says it.
fn in_qemu_words(path: &str, serde: &str) -> String {
    let quoted = |text: &str| text.split('`').nth(1).unwrap_or_default().to_string();
    let member = |name: &str| if path.is_empty() { name.to_string() } else { format!("{path}.{name}") };
    if serde.starts_with("unknown field") {
        // The path ends with the member already.
        format!("Parameter '{path}' is unexpected")
    } else if serde.starts_with("missing field") {
        format!("Parameter '{}' is missing", member(&quoted(serde)))
    } else if serde.starts_with("unknown variant") {
        format!("Parameter '{}' does not accept value '{}'", bare_name(path), quoted(serde))
    } else if let Some(expected) =
        serde.strip_prefix("invalid type: ").and_then(|rest| rest.split(", expected ").nth(1))
        && let Some(kind) = qapi_type(expected)
    {
        format!("Invalid parameter type for '{path}', expected: {kind}")
    } else if let Some(kind) = serde.split(", expected ").nth(1).and_then(unsigned) {
        format!("Parameter '{path}' expects {kind}")
    } else {
        format!("Invalid parameters: {serde}")
    }
}

/// The member name QEMU's enum visitor gives: the path's last member
/// alone, and 'null' for a list element (which has no name).
fn bare_name(path: &str) -> &str {
    match path.rsplit('.').next() {
        Some(last) if last.ends_with(']') => "null",
        Some(last) => last,
        None => path,
    }
}

/// The JSON type QEMU names for what serde expected.
fn qapi_type(expected: &str) -> Option<&'static str> {
    let expected = expected.trim_start_matches("a ").trim_start_matches("an ");
    Some(match expected {
        "boolean" => "boolean",
        "string" => "string",
        "sequence" => "array",
        "map" => "object",
        _ if expected.starts_with("struct ") || expected.starts_with("map") => "object",
        _ if expected.starts_with('u') || expected.starts_with('i') || expected.contains("integer") => "integer",
        _ => return None,
    })
}

/// QEMU's name for an unsigned type an integer did not fit.
fn unsigned(expected: &str) -> Option<&'static str> {
    match expected {
        "u64" => Some("uint64"),
        "u32" => Some("uint32_t"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    #[allow(dead_code)]
    struct Args {
        job_id: String,
        speed: Option<i64>,
        granularity: Option<u32>,
        auto_finalize: Option<bool>,
        mode: Option<Mode>,
        modes: Option<Vec<Mode>>,
        inner: Option<Inner>,
    }

    #[derive(Deserialize, Debug)]
    #[serde(rename_all = "kebab-case")]
    enum Mode {
        Background,
    }

    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        list: Vec<u64>,
        mode: Option<Mode>,
    }

    fn error(args: Value) -> String {
        parse::<Args>(args).unwrap_err().to_string()
    }

    #[test]
    fn mistakes_are_named_as_qemu_names_them() {
        let cases = [
            (json!({"job-id": "x", "bogus": 1}), "Parameter 'bogus' is unexpected"),
            (json!({}), "Parameter 'job-id' is missing"),
            (json!({"job-id": "x", "mode": "sideways"}), "Parameter 'mode' does not accept value 'sideways'"),
            // QEMU's enum errors name the member alone, a list element 'null'.
            (
                json!({"job-id": "x", "inner": {"list": [], "mode": "up"}}),
                "Parameter 'mode' does not accept value 'up'",
            ),
            (json!({"job-id": "x", "modes": ["down"]}), "Parameter 'null' does not accept value 'down'"),
            (json!({"job-id": "x", "speed": "fast"}), "Invalid parameter type for 'speed', expected: integer"),
            (json!({"job-id": 5}), "Invalid parameter type for 'job-id', expected: string"),
            (
                json!({"job-id": "x", "auto-finalize": "yes"}),
                "Invalid parameter type for 'auto-finalize', expected: boolean",
            ),
            (json!({"job-id": "x", "granularity": -1}), "Parameter 'granularity' expects uint32_t"),
            (json!({"job-id": "x", "inner": {}}), "Parameter 'inner.list' is missing"),
            (
                json!({"job-id": "x", "inner": {"list": [1, "2"]}}),
                "Invalid parameter type for 'inner.list[1]', expected: integer",
            ),
        ];
        for (args, want) in cases {
            assert!(error(args.clone()).contains(want), "{args}: {}", error(args.clone()));
        }
    }
}
