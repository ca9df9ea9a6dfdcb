//! `shmstore metrics NAME [--listen ADDR]`: the store's figures for Prometheus.
//!
//! Encoded by prometheus-client (the Prometheus project's Rust client) in the OpenMetrics
//! text format, which Prometheus scrapes natively; served over tiny_http. Every figure
//! comes from [`Store::stats`]: per-client counters added up when read (O(clients), no
//! table scan, no counter shared between processes on the hot path). Only the largest
//! free block is a scan of the allocator's page bitmap (microseconds per GiB).
//!
//! The names, types and labels are the same as those of the Python collector
//! (`shmstore.prometheus.register`), so a dashboard reads either; docs/metrics.md lists
//! them.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use shmstore::Store;
use std::borrow::Cow;

/// The content type of the exposition (OpenMetrics 1.0 text).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub fn run(name: &str, listen: Option<&str>) -> Result<(), String> {
    let store = crate::tools::attach(name)?;
    // Series are labelled with the store's file name, as the Python collector does.
    let path = crate::tools::resolve(name);
    let label = path
        .file_name()
        .map_or_else(|| name.to_string(), |f| f.to_string_lossy().into_owned());
    match listen {
        None => {
            print!("{}", exposition(&store, &label)?);
            Ok(())
        }
        Some(addr) => serve(&store, &label, addr),
    }
}

fn gauge(reg: &mut Registry, name: &str, help: &str, unit: Option<Unit>, v: u64) {
    let g: Gauge = Gauge::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    match unit {
        Some(u) => reg.register_with_unit(name, help, u, g),
        None => reg.register(name, help, g),
    }
}

fn counter(reg: &mut Registry, name: &str, help: &str, unit: Option<Unit>, v: u64) {
    let c: Counter = Counter::default();
    c.inc_by(v);
    match unit {
        Some(u) => reg.register_with_unit(name, help, u, c),
        None => reg.register(name, help, c),
    }
}

type Labeled<M> = Family<[(&'static str, &'static str); 1], M>;

/// The store's figures now, as one OpenMetrics text exposition (ends with `# EOF`).
/// Help texts carry no final period: the encoder adds one.
pub fn exposition(store: &Store, name: &str) -> Result<String, String> {
    let st = store.stats();
    let label = (Cow::Borrowed("store"), Cow::Owned(name.to_string()));
    let mut reg = Registry::with_prefix_and_labels("shmstore", std::iter::once(label));
    let bytes = Some(Unit::Bytes);
    gauge(
        &mut reg,
        "capacity",
        "Bytes the store can hold",
        bytes.clone(),
        st.capacity,
    );
    gauge(
        &mut reg,
        "used",
        "Bytes allocated to objects, including ones being created",
        bytes.clone(),
        st.used,
    );
    gauge(&mut reg, "free", "Bytes free", bytes.clone(), st.free);
    gauge(
        &mut reg,
        "largest_free_block",
        "The largest object that fits without eviction",
        bytes.clone(),
        store.largest_free(),
    );
    gauge(
        &mut reg,
        "huge_page",
        "Heap bytes the store's creator rebuilt as 2 MiB pages",
        bytes.clone(),
        st.huge_page_bytes,
    );
    gauge(&mut reg, "objects", "Sealed objects", None, st.objects);
    gauge(
        &mut reg,
        "objects_creating",
        "Objects created and not yet sealed",
        None,
        st.creating,
    );
    gauge(
        &mut reg,
        "pins",
        "Views held on objects, over all processes",
        None,
        st.pins,
    );
    counter(&mut reg, "creates", "Objects created", None, st.creates);
    counter(
        &mut reg,
        "written",
        "Bytes of objects created",
        bytes.clone(),
        st.bytes_created,
    );
    let gets: Labeled<Counter> = Family::default();
    for (result, n) in [
        ("hit", st.gets_hit),
        ("wait", st.gets_waited),
        ("miss", st.gets_missed),
    ] {
        gets.get_or_create(&[("result", result)]).inc_by(n);
    }
    reg.register(
        "gets",
        "Gets: hit (sealed at once), wait (blocked until sealed), miss",
        gets,
    );
    counter(&mut reg, "deletes", "Objects deleted", None, st.deletes);
    counter(
        &mut reg,
        "evictions",
        "Objects evicted to make room",
        None,
        st.evictions,
    );
    counter(
        &mut reg,
        "evicted",
        "Bytes of objects evicted to make room",
        bytes.clone(),
        st.bytes_evicted,
    );
    counter(
        &mut reg,
        "full_events",
        "Allocations refused because the store was full",
        None,
        st.full_events,
    );
    counter(
        &mut reg,
        "recovered_clients",
        "Dead processes whose pins, creations and allocations were reclaimed",
        None,
        st.recovered_clients,
    );
    counter(
        &mut reg,
        "reclaimed",
        "Bytes reclaimed from dead processes",
        bytes,
        st.reclaimed_bytes,
    );
    let clients: Labeled<Gauge> = Family::default();
    // This process is attached too: not counted.
    let alive = st.clients.saturating_sub(1);
    for (state, n) in [("alive", alive), ("dead", st.dead_clients)] {
        clients
            .get_or_create(&[("state", state)])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    reg.register(
        "clients",
        "Attached processes, alive and dead (not yet recovered)",
        clients,
    );
    let mut out = String::new();
    encode(&mut out, &reg).map_err(|e| format!("encoding the metrics: {e}"))?;
    Ok(out)
}

fn serve(store: &Store, name: &str, addr: &str) -> Result<(), String> {
    let server = tiny_http::Server::http(addr).map_err(|e| {
        format!("cannot listen on {addr}: {e} (give a free HOST:PORT, e.g. 127.0.0.1:9464)")
    })?;
    let bound = server
        .server_addr()
        .to_ip()
        .map_or_else(|| addr.to_string(), |a| a.to_string());
    // Tests and operators read the port (e.g. after --listen 127.0.0.1:0) from this line.
    eprintln!("serving {name} at http://{bound}/metrics");
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("");
        let response = match path {
            "/metrics" => match exposition(store, name) {
                Ok(text) => {
                    tiny_http::Response::from_string(text).with_header(header(CONTENT_TYPE))
                }
                Err(e) => tiny_http::Response::from_string(e).with_status_code(500),
            },
            _ => tiny_http::Response::from_string("shmstore serves /metrics only\n")
                .with_status_code(404),
        };
        // A scraper that hung up early is its own business.
        let _ = request.respond(response);
    }
    Ok(())
}

fn header(content_type: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
        .expect("a static, valid header")
}
