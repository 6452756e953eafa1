//! Lookups of a block by address.

use super::*;

/// A lookup by address (a walk of its segment from the first block) finds
/// a block exactly where one starts, after random churn on streams and
/// without, flushes and trims: none inside a block, past a segment's end
/// or in a vacant slot.
#[test]
fn a_lookup_by_address_finds_exactly_the_blocks_that_start_there() {
    let (sim, ctx, pool) = pool(1 << 30);
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut rnd = move |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    let mut live: Vec<(Grant, usize, Option<usize>)> = Vec::new();
    for step in 0..400 {
        match rnd(10) {
            0..=4 => {
                let n = [512, 4096, 100_000, 700_000, 3 << 20, 12 << 20][rnd(6)];
                let s = [None, Some(S), Some(T)][rnd(3)];
                live.push((alloc(&pool, ctx, n, s), n, s));
            }
            5..=8 if !live.is_empty() => {
                let (g, n, s) = live.swap_remove(rnd(live.len()));
                let on = if rnd(2) == 0 { s } else { None };
                pool.release(ctx, back(g, n), on, || true);
            }
            9 => {
                if rnd(4) == 0 {
                    assert!(pool.trim(ctx, false, |_| {}, |_| {}).1.is_ok());
                } else {
                    assert!(pool.flush(ctx));
                }
            }
            _ => {}
        }
        // Each block's start, 512 bytes either side of it, and each
        // segment's edges: a walk per address, so not every granule.
        let views = pool.allocations();
        let a = pool.arena(0);
        let starts: std::collections::HashSet<_> = views
            .iter()
            .flat_map(|(_, bl)| bl.iter().map(|b| b.0))
            .collect();
        for (seg, blocks) in &views {
            let end = seg.base + seg.bytes as u64;
            let edges = [seg.base.saturating_sub(512), end, end + 512];
            let near = blocks.iter().flat_map(|b| [b.0 - 512, b.0, b.0 + 512]);
            for at in near.chain(edges) {
                let got = a.blocks.slot(at);
                assert_eq!(
                    got.is_some(),
                    starts.contains(&at),
                    "step {step} at {at:#x}"
                );
                if let Some(s) = got {
                    assert_eq!(a.blocks[s].at, at, "step {step}");
                }
            }
        }
    }
    for (g, n, _) in live {
        pool.release(ctx, back(g, n), None, || true);
    }
    emptied(&sim, ctx, &pool);
}

/// Three 4 KiB blocks on `S`, one after another in one segment.
fn three_in_a_row(pool: &Pool, ctx: RawContext) -> (Grant, Grant, Grant) {
    let x = alloc(pool, ctx, 4096, Some(S));
    let y = alloc(pool, ctx, 4096, Some(S));
    let z = alloc(pool, ctx, 4096, Some(S));
    assert_eq!((y.address, z.address), (x.address + 4096, x.address + 8192));
    (x, y, z)
}

/// A block's release finds it by its slot only while that slot holds the
/// block at its address: a stale hand-back whose slot another block took
/// since (a split after a merge), or a slot out of the table, goes by
/// address, and frees nothing that is handed out.
#[test]
fn a_release_whose_slot_went_to_another_block_goes_by_address() {
    let (sim, ctx, pool) = pool(1 << 30);
    let (x, y, z) = three_in_a_row(&pool, ctx);
    // y, then x: x merges with y, whose slot falls vacant; a 6 KiB block
    // cut from the merged 8 KiB leaves its 2 KiB rest in that slot.
    pool.release(ctx, back(y, 4096), Some(S), || true);
    pool.release(ctx, back(x, 4096), Some(S), || true);
    let w = alloc(&pool, ctx, 6144, Some(S));
    assert_eq!((w.address, w.slot), (x.address, x.slot));
    let rest = pool.arena(0).blocks.slot(x.address + 6144);
    assert_eq!(rest, Some(y.slot), "the rest took y's vacant slot");
    let live = pool.stats().live_bytes;
    pool.release(ctx, back(y, 4096), Some(S), || true);
    let bogus = Block {
        slot: u32::MAX,
        ..back(z, 4096)
    };
    pool.release(
        ctx,
        Block {
            address: w.address + 512,
            ..bogus
        },
        Some(S),
        || true,
    );
    assert_eq!(
        pool.stats().live_bytes,
        live,
        "nothing handed out was freed"
    );
    // z, by address past a slot out of the table, is.
    pool.release(ctx, bogus, Some(S), || true);
    assert_eq!(pool.stats().live_bytes, live - 4096);
    pool.release(ctx, back(w, 6144), Some(S), || true);
    emptied(&sim, ctx, &pool);
}

/// A hand-back at address 0 naming a slot a merge emptied (its entry is at
/// 0 and keeps its old state) frees nothing: no block handed out comes to
/// overlap a free one.
#[test]
fn a_release_at_address_zero_naming_a_vacant_slot_frees_nothing() {
    let (_sim, ctx, pool) = pool(1 << 30);
    let (x, y, z) = three_in_a_row(&pool, ctx);
    pool.release(ctx, back(x, 4096), Some(S), || true);
    // y merges into x: y's slot falls vacant with state Used.
    pool.release(ctx, back(y, 4096), Some(S), || true);
    let live = pool.stats().live_bytes;
    let forged = Block {
        address: 0,
        ..back(y, 4096)
    };
    pool.release(ctx, forged, Some(S), || true);
    let live_after = pool.stats().live_bytes;
    let w = alloc(&pool, ctx, 12 << 10, Some(S));
    assert!(
        w.address + (12 << 10) as u64 <= z.address || w.address >= z.address + 4096,
        "w {:#x}+12 KiB overlaps z {:#x}, still handed out (live bytes {live} -> {live_after})",
        w.address,
        z.address
    );
    assert_eq!(live_after, live, "nothing handed out was freed");
}
