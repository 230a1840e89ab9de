//! The QMP protocol state of one connection: capabilities negotiation,
//! then commands, each either in-band (run in order) or out-of-band
//! (`exec-oob`, answered at once, once the client enabled `oob`).

use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::{Dispatch, ErrorClass, QmpError};

/// The capabilities vsd offers, as its greeting lists them.
pub(crate) const CAPABILITIES: &[&str] = &["oob"];

/// Checks a connection's messages and answers what needs no command run.
pub(crate) struct Session {
    dispatch: Arc<dyn Dispatch>,
    mode: Mode,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Only `qmp_capabilities` is accepted.
    Negotiating,
    /// Commands run; `oob` is whether the client enabled out-of-band ones.
    Commands { oob: bool },
}

/// What to do with one message.
pub(crate) enum Step {
    /// Its reply, made at once.
    Answered(Value),
    /// An in-band request, to be answered after those before it.
    InBand(Request),
}

/// An in-band request: a command to run, or a message that was not one,
/// which QEMU answers in order too.
pub(crate) struct Request {
    id: Option<Value>,
    command: Result<Command, QmpError>,
}

/// A well-formed command.
struct Command {
    name: String,
    arguments: Map<String, Value>,
    out_of_band: bool,
}

impl Session {
    pub(crate) fn new(dispatch: Arc<dyn Dispatch>) -> Self {
        Self { dispatch, mode: Mode::Negotiating }
    }

    pub(crate) fn negotiated(&self) -> bool {
        self.mode != Mode::Negotiating
    }

    /// The client enabled out-of-band commands.
    pub(crate) fn out_of_band(&self) -> bool {
        self.mode == Mode::Commands { oob: true }
    }

    /// Takes one input message, or what the JSON parser said of bad input.
    pub(crate) fn handle(&mut self, message: Result<Value, String>) -> Step {
        let (id, command) = match message {
            Ok(input) => (input.get("id").cloned(), parse_command(input, self.out_of_band())),
            Err(parse_error) => (None, Err(QmpError::generic(parse_error))),
        };
        match (self.mode, command) {
            (Mode::Negotiating, command) => Step::Answered(reply(command.and_then(|c| self.negotiate(c)), id)),
            (Mode::Commands { .. }, Ok(command)) if command.out_of_band => {
                let result = self.dispatch.execute_oob(&command.name, command.arguments).map(empty_if_null);
                Step::Answered(reply(result, id))
            }
            (Mode::Commands { .. }, command) => Step::InBand(Request { id, command }),
        }
    }

    fn negotiate(&mut self, command: Command) -> Result<Value, QmpError> {
        if command.name != "qmp_capabilities" {
            return Err(QmpError::new(
                ErrorClass::CommandNotFound,
                "Expecting capabilities negotiation with 'qmp_capabilities'",
            ));
        }
        let oob = enabled(&command.arguments)?;
        self.mode = Mode::Commands { oob };
        Ok(json!({}))
    }
}

impl Request {
    /// Runs the request: its reply, and the name of the command if it
    /// succeeded (for [`Dispatch::after_reply`] once the reply is out).
    pub(crate) fn run(self, dispatch: &dyn Dispatch) -> (Value, Option<String>) {
        let mut succeeded = None;
        let result = self.command.and_then(|command| match command.name.as_str() {
            "qmp_capabilities" => Err(QmpError::new(
                ErrorClass::CommandNotFound,
                "Capabilities negotiation is already complete, command ignored",
            )),
            name => {
                let value = dispatch.execute(name, command.arguments)?;
                succeeded = Some(command.name);
                Ok(empty_if_null(value))
            }
        });
        (reply(result, self.id), succeeded)
    }
}

/// QMP commands without a return value return an empty object.
fn empty_if_null(value: Value) -> Value {
    if value.is_null() { json!({}) } else { value }
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
/// `exec-oob` is a member only once the client enabled `oob`.
fn parse_command(input: Value, oob: bool) -> Result<Command, QmpError> {
    let Value::Object(members) = input else {
        return Err(QmpError::generic("QMP input must be a JSON object"));
    };
    let mut in_band = None;
    let mut out_of_band = None;
    let mut arguments = Map::new();
    for (member, value) in members {
        match (member.as_str(), value) {
            ("execute", Value::String(value)) => in_band = Some(value),
            ("execute", _) => return Err(QmpError::generic("QMP input member 'execute' must be a string")),
            ("exec-oob", Value::String(value)) if oob => out_of_band = Some(value),
            ("exec-oob", _) if oob => return Err(QmpError::generic("QMP input member 'exec-oob' must be a string")),
            ("arguments", Value::Object(value)) => arguments = value,
            ("arguments", _) => return Err(QmpError::generic("QMP input member 'arguments' must be an object")),
            ("id", _) => {}
            (member, _) => return Err(QmpError::generic(format!("QMP input member '{member}' is unexpected"))),
        }
    }
    match (in_band, out_of_band) {
        (Some(_), Some(_)) => Err(QmpError::generic("QMP input member 'execute' clashes with 'exec-oob'")),
        (Some(name), None) => Ok(Command { name, arguments, out_of_band: false }),
        (None, Some(name)) => Ok(Command { name, arguments, out_of_band: true }),
        (None, None) => Err(QmpError::generic("QMP input lacks member 'execute'")),
    }
}

/// Checks the arguments of `qmp_capabilities`: whether they enable `oob`,
/// the one capability vsd offers.
fn enabled(arguments: &Map<String, Value>) -> Result<bool, QmpError> {
    let mut oob = false;
    for (argument, value) in arguments {
        if argument != "enable" {
            return Err(QmpError::generic(format!("Parameter '{argument}' is unexpected")));
        }
        let Value::Array(wanted) = value else {
            return Err(QmpError::generic("Invalid parameter type for 'enable', expected: array"));
        };
        for (i, capability) in wanted.iter().enumerate() {
            let Some(name) = capability.as_str() else {
                return Err(QmpError::generic(format!("Invalid parameter type for 'enable[{i}]', expected: string")));
            };
            if !CAPABILITIES.contains(&name) {
                // QEMU 10's words, 'null' and all.
                return Err(QmpError::generic(format!("Parameter 'null' does not accept value '{name}'")));
            }
            oob = true;
        }
    }
    Ok(oob)
}
