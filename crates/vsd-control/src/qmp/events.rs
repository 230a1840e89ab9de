//! Asynchronous events.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::output::Output;

/// Broadcasts asynchronous events to every connection that has completed
/// capabilities negotiation, and only to those.
#[derive(Clone, Default)]
pub struct Events {
    /// Every connection, until it closes.
    listeners: Arc<Mutex<Vec<Weak<Output>>>>,
}

impl Events {
    /// A broadcaster with no listeners yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends the event `event` with `data` to every negotiated connection.
    pub fn emit(&self, event: &str, data: Value) {
        let event = json!({"event": event, "data": data, "timestamp": timestamp()});
        // Writing under the lock keeps events in the same order on every
        // connection.
        let mut listeners = self.listeners.lock().unwrap_or_else(PoisonError::into_inner);
        listeners.retain(|listener| listener.upgrade().is_some_and(|output| output.send_event(&event).is_ok()));
    }

    /// Adds a connection; events reach it once it has negotiated.
    pub(crate) fn listen(&self, output: &Arc<Output>) {
        let mut listeners = self.listeners.lock().unwrap_or_else(PoisonError::into_inner);
        // Without events to prune them, closed connections would pile up.
        listeners.retain(|listener| listener.strong_count() > 0);
        listeners.push(Arc::downgrade(output));
    }
}

/// The wall clock, as QMP events carry it.
fn timestamp() -> Value {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    json!({"seconds": now.as_secs(), "microseconds": now.subsec_micros()})
}
