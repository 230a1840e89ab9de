//! The QMP protocol state of one connection.

use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::{Dispatch, ErrorClass, QmpError};

/// Runs a connection's commands.
pub(crate) struct Session {
    dispatch: Arc<dyn Dispatch>,
    /// Capabilities negotiation is complete: the session is in command mode.
    negotiated: bool,
    /// The command that just succeeded, until its reply is sent.
    completed: Option<String>,
}

/// A well-formed command.
struct Command {
    name: String,
    arguments: Map<String, Value>,
}

impl Session {
    pub(crate) fn new(dispatch: Arc<dyn Dispatch>) -> Self {
        Self { dispatch, negotiated: false, completed: None }
    }

    pub(crate) fn negotiated(&self) -> bool {
        self.negotiated
    }

    /// Runs one input message and returns the reply, which echoes the
    /// message's "id", whatever else is wrong with it.
    pub(crate) fn handle(&mut self, input: Value) -> Value {
        let id = input.get("id").cloned();
        let result = parse_command(input).and_then(|command| self.run(command));
        reply(result, id)
    }

    fn run(&mut self, command: Command) -> Result<Value, QmpError> {
        match (self.negotiated, command.name.as_str()) {
            (false, "qmp_capabilities") => {
                negotiate(&command.arguments)?;
                self.negotiated = true;
                Ok(json!({}))
            }
            (false, _) => Err(QmpError::new(
                ErrorClass::CommandNotFound,
                "Expecting capabilities negotiation with 'qmp_capabilities'",
            )),
            (true, "qmp_capabilities") => Err(QmpError::new(
                ErrorClass::CommandNotFound,
                "Capabilities negotiation is already complete, command ignored",
            )),
            (true, name) => {
                let value = self.dispatch.execute(name, command.arguments)?;
                self.completed = Some(command.name);
                // QMP commands without a return value return an empty object.
                Ok(if value.is_null() { json!({}) } else { value })
            }
        }
    }

    /// Tells the dispatcher that the reply to the last input went out.
    pub(crate) fn after_reply(&mut self) {
        if let Some(command) = self.completed.take() {
            self.dispatch.after_reply(&command);
        }
    }
}

/// A reply to a command, or to input that was not one.
pub(crate) fn reply(result: Result<Value, QmpError>, id: Option<Value>) -> Value {
    let mut reply = match result {
        Ok(value) => json!({"return": value}),
        Err(error) => json!({"error": error}),
    };
    if let Some(id) = id {
        reply["id"] = id;
    }
    reply
}

/// Checks the shape of a command, with QEMU's words for what is wrong.
fn parse_command(input: Value) -> Result<Command, QmpError> {
    let Value::Object(members) = input else {
        return Err(QmpError::generic("QMP input must be a JSON object"));
    };
    let mut name = None;
    let mut arguments = Map::new();
    for (member, value) in members {
        match (member.as_str(), value) {
            ("execute", Value::String(value)) => name = Some(value),
            ("execute", _) => return Err(QmpError::generic("QMP input member 'execute' must be a string")),
            ("arguments", Value::Object(value)) => arguments = value,
            ("arguments", _) => return Err(QmpError::generic("QMP input member 'arguments' must be an object")),
            ("id", _) => {}
            // Including "exec-oob": out-of-band execution is a capability
            // that vsd does not offer.
            (member, _) => return Err(QmpError::generic(format!("QMP input member '{member}' is unexpected"))),
        }
    }
    let name = name.ok_or_else(|| QmpError::generic("QMP input lacks member 'execute'"))?;
    Ok(Command { name, arguments })
}

/// Checks the arguments of `qmp_capabilities`: vsd offers no capabilities,
/// so none can be enabled.
fn negotiate(arguments: &Map<String, Value>) -> Result<(), QmpError> {
    for (argument, value) in arguments {
        match (argument.as_str(), value) {
            ("enable", Value::Array(wanted)) if wanted.is_empty() => {}
            ("enable", Value::Array(wanted)) => {
                let wanted: Vec<String> =
                    wanted.iter().map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned)).collect();
                return Err(QmpError::generic(format!("Capability {} not available", wanted.join(", "))));
            }
            ("enable", _) => return Err(QmpError::generic("Invalid parameter type for 'enable', expected: array")),
            (argument, _) => return Err(QmpError::generic(format!("Parameter '{argument}' is unexpected"))),
        }
    }
    Ok(())
}
