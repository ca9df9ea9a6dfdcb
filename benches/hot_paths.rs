//! In-process hot paths, with criterion. The cross-process figures (and their floors) come
//! from `shmstore bench`; these track regressions in the single-process cost of each call.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use shmstore::{ObjectId, Store, StoreConfig};
use std::hint::black_box;

fn store() -> Store {
    Store::create_anonymous(&StoreConfig {
        max_objects: 1 << 16,
        ..StoreConfig::with_capacity(256 << 20)
    })
    .expect("anonymous store")
}

fn hot_paths(c: &mut Criterion) {
    let s = store();
    let id = ObjectId::of_key("hot");
    s.put(&id, &[7u8; 4096]).unwrap();
    c.bench_function("try_get hit + drop", |b| {
        b.iter(|| drop(black_box(s.try_get(black_box(&id)).unwrap())))
    });
    c.bench_function("contains", |b| {
        b.iter(|| black_box(s.contains(black_box(&id))))
    });

    for size in [64usize, 4096] {
        let data = vec![1u8; size];
        let ids: Vec<ObjectId> = (0..1024)
            .map(|i| ObjectId::of_key(format!("p{size}-{i}")))
            .collect();
        let mut g = c.benchmark_group(format!("put + delete {size} B"));
        g.throughput(Throughput::Elements(1));
        let mut k = 0;
        g.bench_function("put+delete", |b| {
            b.iter(|| {
                let id = &ids[k % ids.len()];
                k += 1;
                s.put(id, &data).unwrap();
                s.delete(id).unwrap();
            })
        });
        g.finish();
    }

    let mut g = c.benchmark_group("allocator");
    for size in [64u64, 1 << 20] {
        g.bench_function(format!("alloc+free {size} B"), |b| {
            b.iter(|| s.raw_free(s.raw_alloc(black_box(size)).unwrap()).unwrap())
        });
    }
    g.finish();

    let big = vec![3u8; 16 << 20];
    let big_id = ObjectId::of_key("big");
    let mut g = c.benchmark_group("put 16 MiB");
    g.throughput(Throughput::Bytes(big.len() as u64));
    g.sample_size(20);
    g.bench_function("put+delete", |b| {
        b.iter(|| {
            s.put(&big_id, &big).unwrap();
            s.delete(&big_id).unwrap();
        })
    });
    g.bench_function("memcpy (floor)", |b| {
        let mut dst = vec![0u8; big.len()];
        b.iter(|| dst.copy_from_slice(black_box(&big)))
    });
    g.finish();
}

criterion_group!(benches, hot_paths);
criterion_main!(benches);
