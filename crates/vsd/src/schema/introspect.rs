//! QEMU's introspection format (`qapi/introspect.json`) built from the
//! JSON Schemas that `schemars` derives from the types commands parse
//! their arguments into: one entity per type, builtins by name, the
//! others masked as QEMU masks them (numbered in order of first use,
//! arrays as `[ELEMENT]`), each distinct shape once.

use std::collections::HashMap;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{Map, Value, json};

/// The features a schema extension `x-features` lists, as a member's,
/// a type's or a command's QEMU features (`unstable` for vsd's own).
pub(crate) const FEATURES: &str = "x-features";

/// Collects the entities of `query-qmp-schema`.
pub(crate) struct Introspection {
    generator: SchemaGenerator,
    entities: Vec<Value>,
    /// The name given to each anonymous shape listed, by its JSON text.
    shapes: HashMap<String, String>,
    /// The name given to each definition, set before its shape is known
    /// so that a type can contain itself (BlockdevRef in BlockdevOptions).
    definitions: HashMap<String, String>,
    /// Names given so far.
    named: usize,
}

impl Introspection {
    pub(crate) fn new() -> Self {
        Self {
            generator: SchemaGenerator::default(),
            entities: Vec::new(),
            shapes: HashMap::new(),
            definitions: HashMap::new(),
            named: 0,
        }
    }

    /// Declares the definition `name` (the types whose schemas are
    /// written by hand), for `{"$ref": "#/$defs/NAME"}` to name it.
    pub(crate) fn define(&mut self, name: &str, schema: Value) {
        if let Ok(schema) = Schema::try_from(schema) {
            self.generator.definitions_mut().insert(name.to_string(), schema.to_value());
        }
    }

    /// The schema of `T`, for [`Introspection::command`] and friends.
    pub(crate) fn schema_of<T: JsonSchema>(&mut self) -> Value {
        self.generator.subschema_for::<T>().to_value()
    }

    /// Lists command `name` with arguments of schema `args` (`None`: it
    /// takes none) answering with `returns` (`None`: `{}`).
    pub(crate) fn command(&mut self, name: &str, args: Option<Value>, returns: Option<Value>, oob: bool) {
        let mut entity = json!({
            "name": name,
            "meta-type": "command",
            "arg-type": self.object_or_empty(args.as_ref()),
            "ret-type": match &returns {
                Some(returns) => self.type_name(returns),
                None => self.object_or_empty(None),
            },
        });
        if oob {
            entity["allow-oob"] = json!(true);
        }
        self.add_features(&mut entity, args.as_ref());
        self.entities.push(entity);
    }

    /// Lists event `name` with data of schema `data` (`None`: none).
    pub(crate) fn event(&mut self, name: &str, data: Option<Value>) {
        let entity = json!({"name": name, "meta-type": "event", "arg-type": self.object_or_empty(data.as_ref())});
        self.entities.push(entity);
    }

    /// Every entity, builtins included.
    pub(crate) fn finish(mut self) -> Value {
        for (name, json_type) in [
            ("str", "string"),
            ("int", "int"),
            ("number", "number"),
            ("bool", "boolean"),
            ("null", "null"),
            ("any", "value"),
        ] {
            self.entities.push(json!({"name": name, "meta-type": "builtin", "json-type": json_type}));
        }
        Value::Array(self.entities)
    }

    fn object_or_empty(&mut self, schema: Option<&Value>) -> String {
        match schema {
            Some(schema) => self.type_name(schema),
            None => self.entity(json!({"meta-type": "object", "members": []})),
        }
    }

    /// A command's features are those of its argument type.
    fn add_features(&self, entity: &mut Value, args: Option<&Value>) {
        if let Some(features) = args.map(|a| self.resolve(a)).and_then(|a| a.get(FEATURES)) {
            entity["features"] = features.clone();
        }
    }

    /// The introspection name of the type `schema` describes.
    fn type_name(&mut self, schema: &Value) -> String {
        match schema.get("$ref").and_then(Value::as_str).and_then(|r| r.rsplit('/').next()) {
            Some(definition) => self.defined(definition),
            None => self.shape_name(schema),
        }
    }

    /// The name of a definition, its entity listed the first time.
    fn defined(&mut self, definition: &str) -> String {
        if let Some(name) = self.definitions.get(definition) {
            return name.clone();
        }
        let name = self.next_name();
        self.definitions.insert(definition.to_string(), name.clone());
        let Some(schema) = self.generator.definitions().get(definition).cloned() else {
            return "any".into();
        };
        let listed = self.entities.len();
        let shape = self.shape_name(&schema);
        // The definition's own entity is the one made for its shape.
        match self.entities[listed..].iter_mut().rev().find(|e| e["name"] == shape.as_str()) {
            Some(entity) => entity["name"] = json!(name),
            None => {
                // A builtin, or a shape listed before: an alias.
                self.definitions.insert(definition.to_string(), shape.clone());
                return shape;
            }
        }
        self.shapes.insert(shape_key(&self.entities, &name), name.clone());
        name
    }

    fn shape_name(&mut self, schema: &Value) -> String {
        let schema = schema.clone();
        let Some(object) = schema.as_object() else {
            // `true`: any JSON value (serde_json's Value).
            return "any".into();
        };
        if let Some(values) = enumerated(object) {
            let members: Vec<Value> = values.iter().map(|v| json!({ "name": v })).collect();
            return self.entity(json!({"meta-type": "enum", "members": members, "values": values}));
        }
        if let Some(choices) = object.get("anyOf").or_else(|| object.get("oneOf")).and_then(Value::as_array) {
            return self.choice(choices);
        }
        let kinds: Vec<&str> = match object.get("type") {
            Some(Value::String(kind)) => vec![kind],
            Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).filter(|k| *k != "null").collect(),
            _ => Vec::new(),
        };
        match kinds.as_slice() {
            ["string"] => "str".into(),
            ["integer"] => "int".into(),
            ["number"] => "number".into(),
            ["boolean"] => "bool".into(),
            ["null"] => "null".into(),
            ["array"] => {
                let element = object.get("items").map_or_else(|| "any".into(), |items| self.type_name(items));
                let name = format!("[{element}]");
                self.listed(&name, json!({"name": name, "meta-type": "array", "element-type": element}));
                name
            }
            ["object"] if object.contains_key("properties") => self.object(object),
            _ => "any".into(),
        }
    }

    /// An alternate (serde's untagged enum), a union (an internally tagged
    /// one) or an optional value (`T` or null, which the member's
    /// optionality says).
    fn choice(&mut self, choices: &[Value]) -> String {
        let resolved: Vec<Value> = choices.iter().map(|c| self.resolve(c).clone()).collect();
        let not_null: Vec<&Value> = choices
            .iter()
            .zip(&resolved)
            .filter(|(_, r)| r.get("type") != Some(&json!("null")))
            .map(|(c, _)| c)
            .collect();
        if let [only] = not_null.as_slice() {
            return self.type_name(only);
        }
        if let Some(tag) = common_tag(&resolved) {
            return self.union(&tag, &resolved);
        }
        let members: Vec<Value> = not_null.iter().map(|c| json!({ "type": self.type_name(c) })).collect();
        self.entity(json!({"meta-type": "alternate", "members": members}))
    }

    /// A flat union: the tag and the members every case has alike as its
    /// base, each case's other members as its variant.
    fn union(&mut self, tag: &str, choices: &[Value]) -> String {
        let shared = shared_members(tag, choices);
        let mut cases = Vec::new();
        let mut variants = Vec::new();
        for choice in choices {
            let case = choice["properties"][tag]["const"].as_str().unwrap_or_default().to_string();
            let mut own = choice.as_object().cloned().unwrap_or_default();
            if let Some(Value::Object(properties)) = own.get_mut("properties") {
                properties.retain(|name, _| name != tag && !shared.contains(name));
            }
            variants.push(json!({"case": case, "type": self.object(&own)}));
            cases.push(Value::String(case));
        }
        let tag_type = self.entity(json!({
            "meta-type": "enum",
            "members": cases.iter().map(|c| json!({ "name": c })).collect::<Vec<_>>(),
            "values": cases,
        }));
        let mut base = choices.first().and_then(Value::as_object).cloned().unwrap_or_default();
        if let Some(Value::Object(properties)) = base.get_mut("properties") {
            properties.retain(|name, _| shared.contains(name));
            properties.insert(tag.to_string(), json!({"type": "string"}));
        }
        let base_name = self.object(&base);
        let mut entity = self.entities.iter().find(|e| e["name"] == base_name.as_str()).cloned().unwrap_or_default();
        if let Some(members) = entity["members"].as_array_mut() {
            for member in members.iter_mut().filter(|m| m["name"] == tag) {
                member["type"] = json!(tag_type);
            }
            // The tag comes first, as in QEMU's unions.
            members.sort_by_key(|m| m["name"] != tag);
        }
        let object = entity.as_object_mut().expect("an object entity");
        object.remove("name");
        object.insert("tag".into(), json!(tag));
        object.insert("variants".into(), json!(variants));
        self.entity(entity)
    }

    fn object(&mut self, object: &Map<String, Value>) -> String {
        let required: Vec<&str> =
            object.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let mut members = Vec::new();
        for (name, schema) in object.get("properties").and_then(Value::as_object).into_iter().flatten() {
            let mut member = json!({"name": name, "type": self.type_name(schema)});
            if !required.contains(&name.as_str()) {
                member["default"] = Value::Null;
            }
            if let Some(features) = schema.get(FEATURES) {
                member["features"] = features.clone();
            }
            members.push(member);
        }
        let mut entity = json!({"meta-type": "object", "members": members});
        if let Some(features) = object.get(FEATURES) {
            entity["features"] = features.clone();
        }
        self.entity(entity)
    }

    /// Follows a `$ref` to the definition it names.
    fn resolve<'a>(&'a self, schema: &'a Value) -> &'a Value {
        let name = schema.get("$ref").and_then(Value::as_str).and_then(|r| r.rsplit('/').next());
        match name.and_then(|name| self.generator.definitions().get(name)) {
            Some(definition) => self.resolve(definition),
            None => schema,
        }
    }

    fn next_name(&mut self) -> String {
        self.named += 1;
        (self.named - 1).to_string()
    }

    /// The name of the entity `shape` (without a name), listed once.
    fn entity(&mut self, shape: Value) -> String {
        let key = shape.to_string();
        if let Some(name) = self.shapes.get(&key) {
            return name.clone();
        }
        let name = self.next_name();
        self.shapes.insert(key, name.clone());
        let mut entity = shape;
        entity["name"] = json!(name);
        self.entities.push(entity);
        name
    }

    /// Lists `entity`, named `name` already, once.
    fn listed(&mut self, name: &str, entity: Value) {
        if !self.entities.iter().any(|e| e["name"] == name) {
            self.entities.push(entity);
        }
    }
}

/// The values of an enum of strings: `enum`, or `oneOf` of `const`s (what
/// schemars makes of variants with doc comments).
fn enumerated(object: &Map<String, Value>) -> Option<Vec<Value>> {
    if let Some(Value::Array(values)) = object.get("enum") {
        return Some(values.clone());
    }
    let choices = object.get("oneOf").or_else(|| object.get("anyOf"))?.as_array()?;
    choices.iter().map(|c| c.get("const").filter(|v| v.is_string()).cloned()).collect()
}

/// The member every choice fixes to a constant string, if there is one:
/// the tag of a serde internally tagged enum.
fn common_tag(choices: &[Value]) -> Option<String> {
    let first = choices.first()?.get("properties")?.as_object()?;
    let tag = first.iter().find(|(_, schema)| schema.get("const").is_some())?.0;
    choices.iter().all(|c| c["properties"][tag]["const"].is_string()).then(|| tag.clone())
}

/// The JSON text of entity `name`'s shape, its name left out.
fn shape_key(entities: &[Value], name: &str) -> String {
    let mut entity = entities.iter().find(|e| e["name"] == name).cloned().unwrap_or_default();
    if let Some(object) = entity.as_object_mut() {
        object.remove("name");
    }
    entity.to_string()
}

/// The members other than `tag` that every choice has, with the same
/// schema and the same optionality.
fn shared_members(tag: &str, choices: &[Value]) -> Vec<String> {
    let required =
        |choice: &Value, name: &str| choice["required"].as_array().is_some_and(|r| r.iter().any(|m| m == name));
    let Some(first) = choices.first().and_then(|c| c["properties"].as_object()) else {
        return Vec::new();
    };
    first
        .iter()
        .filter(|(name, schema)| {
            name.as_str() != tag
                && choices.iter().all(|c| {
                    c["properties"].get(name.as_str()) == Some(*schema)
                        && required(c, name) == required(&choices[0], name)
                })
        })
        .map(|(name, _)| name.clone())
        .collect()
}
