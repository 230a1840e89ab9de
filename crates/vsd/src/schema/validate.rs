//! Whether a JSON value has the shape a schema of this module's dialect
//! describes: debug builds check every reply of a command against its
//! declared return type, so that the schema cannot drift from what the
//! handlers build.

use serde_json::{Map, Value};

/// Where `value` leaves `schema` (`$ref`s resolved in `definitions`): the
/// path of the first mismatch and what was expected there.
pub(crate) fn mismatch(schema: &Value, value: &Value, definitions: &Map<String, Value>) -> Option<String> {
    check(schema, value, definitions, "").err()
}

fn check(schema: &Value, value: &Value, defs: &Map<String, Value>, at: &str) -> Result<(), String> {
    let Some(schema) = schema.as_object() else {
        // `true`: anything.
        return Ok(());
    };
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        let name = reference.rsplit('/').next().unwrap_or_default();
        let definition = defs.get(name).ok_or_else(|| format!("{at}: no definition '{name}'"))?;
        return check(definition, value, defs, at);
    }
    if let Some(constant) = schema.get("const") {
        return expect(constant == value, at, &format!("{constant}"));
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        return expect(values.contains(value), at, &format!("one of {values:?}"));
    }
    if let Some(Value::Array(choices)) = schema.get("anyOf").or_else(|| schema.get("oneOf")) {
        let fits = choices.iter().any(|choice| check(choice, value, defs, at).is_ok());
        return expect(fits, at, "one of its alternatives");
    }
    let kinds: Vec<&str> = match schema.get("type") {
        Some(Value::String(kind)) => vec![kind],
        Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).collect(),
        _ => return Ok(()),
    };
    let kind = kinds.iter().find(|kind| of_kind(kind, value)).ok_or_else(|| format!("{at}: not {kinds:?}"))?;
    match *kind {
        "array" => {
            let items = schema.get("items").cloned().unwrap_or(Value::Bool(true));
            let mut elements = value.as_array().into_iter().flatten().enumerate();
            elements.try_for_each(|(i, element)| check(&items, element, defs, &format!("{at}[{i}]")))
        }
        "object" => members(schema, value.as_object().expect("an object"), defs, at),
        _ => Ok(()),
    }
}

/// Every required member is there, and every member there is described.
fn members(
    schema: &Map<String, Value>,
    object: &Map<String, Value>,
    defs: &Map<String, Value>,
    at: &str,
) -> Result<(), String> {
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return Ok(());
    };
    let required = schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str);
    if let Some(missing) = required.into_iter().find(|name| !object.contains_key(*name)) {
        return Err(format!("{at}.{missing}: missing"));
    }
    for (name, value) in object {
        let member = properties.get(name).ok_or_else(|| format!("{at}.{name}: not in the schema"))?;
        check(member, value, defs, &format!("{at}.{name}"))?;
    }
    Ok(())
}

fn of_kind(kind: &str, value: &Value) -> bool {
    match kind {
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        _ => false,
    }
}

fn expect(fits: bool, at: &str, what: &str) -> Result<(), String> {
    if fits { Ok(()) } else { Err(format!("{at}: not {what}")) }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn values_are_held_to_the_schema() {
        let schema = json!({"type": "array", "items": {"type": "object",
            "properties": {"id": {"type": "string"}, "n": {"type": ["integer", "null"]}, "kind": {"enum": ["a", "b"]}},
            "required": ["id"]}});
        let defs = Map::new();
        assert_eq!(mismatch(&schema, &json!([{"id": "x", "n": 3, "kind": "a"}]), &defs), None);
        assert_eq!(mismatch(&schema, &json!([{"n": 3}]), &defs).unwrap(), "[0].id: missing");
        assert_eq!(mismatch(&schema, &json!([{"id": "x", "m": 1}]), &defs).unwrap(), "[0].m: not in the schema");
        assert!(
            mismatch(&schema, &json!([{"id": "x", "kind": "c"}]), &defs).unwrap().starts_with("[0].kind: not one of")
        );
        assert!(mismatch(&schema, &json!({"id": "x"}), &defs).unwrap().starts_with(": not"));
    }
}
