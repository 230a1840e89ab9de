//! The metrics endpoint, over TCP.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vsd_control::metrics::{MetricsServer, Sources};

const METRICS: &str = "# TYPE vsd_requests_total counter\nvsd_requests_total{export=\"disk0\"} 42\n";
const STATUS: &str = r#"{"exports":[]}"#;

fn server() -> MetricsServer {
    let sources = Sources { metrics: Arc::new(|| METRICS.to_owned()), status: Arc::new(|| STATUS.to_owned()) };
    MetricsServer::start("127.0.0.1:0", sources).expect("start")
}

/// Sends `request` and returns the whole response, split into head and body.
fn exchange(server: &MetricsServer, request: &str) -> (String, String) {
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{response:?}"));
    (head.to_owned(), body.to_owned())
}

#[test]
fn metrics_are_served() {
    let server = server();
    let (head, body) = exchange(&server, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
    let mut lines = head.lines();
    assert_eq!(lines.next(), Some("HTTP/1.1 200 OK"));
    let headers: Vec<&str> = lines.collect();
    assert!(headers.contains(&"Content-Type: text/plain; version=0.0.4; charset=utf-8"), "{head}");
    assert!(headers.contains(&format!("Content-Length: {}", METRICS.len()).as_str()), "{head}");
    assert!(headers.contains(&"Connection: close"), "{head}");
    assert_eq!(body, METRICS);
}

#[test]
fn status_page_and_its_data_are_served() {
    let server = server();
    let (head, body) = exchange(&server, "GET /status.json HTTP/1.1\r\n\r\n");
    assert!(head.contains("\r\nContent-Type: application/json"), "{head}");
    assert_eq!(body, STATUS);
    let (head, body) = exchange(&server, "GET /?refresh HTTP/1.1\r\n\r\n");
    assert!(head.contains("\r\nContent-Type: text/html; charset=utf-8"), "{head}");
    assert!(body.contains("status.json"), "{body}");
}

#[test]
fn query_strings_and_bare_newlines_are_accepted() {
    let server = server();
    let (head, body) = exchange(&server, "GET /metrics?name[]=x HTTP/1.0\n\n");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert_eq!(body, METRICS);
}

#[test]
fn other_paths_and_methods_are_refused() {
    let server = server();
    let (head, _) = exchange(&server, "GET /other HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 404 Not Found\r\n"), "{head}");
    let (head, _) = exchange(&server, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{head}");
    assert!(head.contains("\r\nAllow: GET"), "{head}");
    let (head, _) = exchange(&server, "nonsense\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
}

#[test]
fn oversized_request_is_refused() {
    let server = server();
    let request = format!("GET /metrics HTTP/1.1\r\nX-Padding: {}\r\n\r\n", "p".repeat(32 * 1024));
    let (head, _) = exchange(&server, &request);
    assert!(head.starts_with("HTTP/1.1 431 "), "{head}");
}

#[test]
fn silent_client_does_not_hold_up_scrapes() {
    let server = server();
    let _silent = TcpStream::connect(server.local_addr()).unwrap();
    let start = Instant::now();
    let (_, body) = exchange(&server, "GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(body, METRICS);
    assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
}

#[test]
fn dropping_the_server_stops_it() {
    let server = server();
    let addr = server.local_addr();
    let _idle = TcpStream::connect(addr).unwrap();
    drop(server);
    assert!(TcpStream::connect(addr).is_err());
}
