//! vsd's control plane.
//!
//! - [`qmp`]: the QMP monitor (QEMU Machine Protocol), speaking to QEMU's own
//!   clients (`qemu.qmp`, libvirt, `socat`) over a unix or TCP socket, or on
//!   the daemon's standard input and output;
//! - [`client`]: a blocking QMP client for vsd's own tools;
//! - [`metrics`]: an HTTP endpoint for Prometheus to scrape.

#![deny(missing_docs)]

pub mod client;
mod listener;
pub mod metrics;
pub mod qmp;

pub use client::{ClientError, QmpClient};
pub use metrics::MetricsServer;
pub use qmp::{Dispatch, ErrorClass, Events, QmpError, QmpServer};
