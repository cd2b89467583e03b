/* The embedding cache's bookkeeping and I/O (recc.kernels.cpu.table_cache).
 *
 * A cached table group keeps S slots in memory in front of a store file holding all R rows.
 * Index, all owned by the caller (torch tensors):
 *   map[R]        int32: the slot holding row r, or -1
 *   slot_row[S]   int64: the row in slot s, or -1 (free)
 *   ref[S]        uint8: CLOCK's reference bit (set on every use; the hand clears it)
 *   pin[S]        int64: the newest batch (sequence number) that uses slot s
 *   dirty[S]      uint8: slot s was handed to a training lookup since it was last written back
 *   hand          int64: CLOCK's position
 *
 * recc_cache_assign maps one batch's rows (every id, duplicates included) to slots. Hits
 * first (so a row this batch uses can never be chosen as a victim for another of its rows),
 * then each distinct miss takes the
 * next slot CLOCK finds that is free, or unreferenced and pinned by no batch still in flight
 * (pin < oldest_live): the batches whose backward has not run yet keep their rows. An evicted
 * dirty row is reported for write-back before its slot is refilled.
 *
 * recc_store_io moves records between the store and the slots: record = the concatenation of
 * nparts parts (weights row, then each optimizer-state row), part k of slot s at
 * base[k] + s * bytes[k]. Rows arrive sorted; runs of consecutive rows are read or written
 * with one pread/pwrite each (up to RUN_BYTES), spread over nthreads threads, so the store sees
 * large sequential requests where the ids allow and several requests in flight otherwise. A write
 * call leaves at most its own pages dirty (see the end of recc_store_io).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int64_t recc_cache_assign(int64_t R, int64_t S, int32_t* map, int64_t* slot_row, uint8_t* ref,
                          int64_t* pin, uint8_t* dirty, int64_t* hand, const int64_t* ids,
                          int64_t n, int64_t seq, int64_t oldest_live, int mark_dirty,
                          int64_t* out_slots, int64_t* fetch_rows, int64_t* fetch_slots,
                          int64_t* n_fetch, int64_t* wb_rows, int64_t* wb_slots, int64_t* n_wb,
                          int64_t* n_hit, int64_t* bad) {
    /* ids: the batch's rows, duplicates and all (no sort, no unique: the map itself finds a
     * row met before). out_slots[i]: the slot of ids[i]. *n_hit: distinct rows found cached;
     * the misses (distinct) are the fetch list. Returns 0; -1 with *bad = the index of an id
     * outside [0, R) (nothing changed); -2 when no evictable slot is left (in-flight batches
     * pin too many: *bad = the id that found none). On -2 the index maps every row placed
     * before it: the caller must still write back what they evicted and read them (n_fetch /
     * n_wb are set). */
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= R) {
            *bad = i;
            return -1;
        }
    }
    int64_t nf = 0, nw = 0, nh = 0;
    /* Pass 1, hits: pinned before any miss looks for a victim, so a row this batch uses is
     * never evicted for another of its rows. */
    for (int64_t i = 0; i < n; i++) {
        int32_t s = map[ids[i]];
        out_slots[i] = s;
        if (s >= 0) {
            if (pin[s] != seq) {
                nh++;
                pin[s] = seq;
            }
            ref[s] = 1;
            if (mark_dirty) dirty[s] = 1;
        }
    }
    /* Pass 2, misses, in id order; a row missed twice is placed once (the map has it then). */
    int64_t h = *hand;
    for (int64_t i = 0; i < n; i++) {
        if (out_slots[i] >= 0) continue;
        int64_t r = ids[i];
        if (map[r] >= 0) {
            out_slots[i] = map[r];
            continue;
        }
        /* Two sweeps clear every reference bit; past that only pins can be in the way. */
        int64_t tries = 0, found = -1;
        while (tries < 2 * S + 1) {
            int64_t s = h;
            h = (h + 1 == S) ? 0 : h + 1;
            tries++;
            if (slot_row[s] >= 0 && pin[s] >= oldest_live) continue;
            if (slot_row[s] >= 0 && ref[s]) {
                ref[s] = 0;
                continue;
            }
            found = s;
            break;
        }
        if (found < 0) {
            *hand = h;
            *n_fetch = nf;
            *n_wb = nw;
            *n_hit = nh;
            *bad = i;
            return -2;
        }
        int64_t old = slot_row[found];
        if (old >= 0) {
            if (dirty[found]) {
                wb_rows[nw] = old;
                wb_slots[nw] = found;
                nw++;
            }
            map[old] = -1;
        }
        map[r] = (int32_t)found;
        slot_row[found] = r;
        ref[found] = 1;
        pin[found] = seq;
        dirty[found] = (uint8_t)(mark_dirty != 0);
        out_slots[i] = found;
        fetch_rows[nf] = r;
        fetch_slots[nf] = found;
        nf++;
    }
    *hand = h;
    *n_fetch = nf;
    *n_wb = nw;
    *n_hit = nh;
    return 0;
}

#define RUN_BYTES (256 * 1024)

static int full_io(int fd, int write, char* buf, size_t len, off_t off) {
    while (len) {
        ssize_t k = write ? pwrite(fd, buf, len, off) : pread(fd, buf, len, off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (k == 0) return -EIO; /* read past the end: a store shorter than its header says */
        buf += k;
        len -= (size_t)k;
        off += k;
    }
    return 0;
}

int recc_store_io(int fd, int write, int64_t header, int64_t record, int nparts, const int64_t* bytes,
                  char* const* base, const int64_t* rows, const int64_t* slots, int64_t n, int nthreads) {
    /* Returns 0 or -errno of the first failed request. */
    if (n <= 0) return 0;
    if (write) {
        if (sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WAIT_BEFORE) != 0) return -errno;
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    int64_t per_run = RUN_BYTES / record;
    if (per_run < 1) per_run = 1;
    /* Runs of consecutive rows, each at most per_run long: run j covers rows[start[j]..start[j+1]). */
    int64_t* start = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!start) return -ENOMEM;
    int64_t runs = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || rows[i] != rows[i - 1] + 1 || i - start[runs - 1] >= per_run) start[runs++] = i;
    }
    start[runs] = n;
    int err = 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > runs) nthreads = (int)runs;
#pragma omp parallel num_threads(nthreads)
    {
        char* buf = (char*)malloc((size_t)(per_run * record));
        int my_err = buf ? 0 : -ENOMEM;
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < runs; j++) {
            if (my_err) continue;
            int64_t a = start[j], b = start[j + 1];
            size_t len = (size_t)((b - a) * record);
            off_t off = (off_t)(header + rows[a] * record);
            if (write) {
                for (int64_t i = a; i < b; i++) {
                    char* rec = buf + (i - a) * record;
                    for (int k = 0; k < nparts; k++) {
                        memcpy(rec, base[k] + slots[i] * bytes[k], (size_t)bytes[k]);
                        rec += bytes[k];
                    }
                }
                my_err = full_io(fd, 1, buf, len, off);
            } else {
                my_err = full_io(fd, 0, buf, len, off);
                if (!my_err) {
                    for (int64_t i = a; i < b; i++) {
                        const char* rec = buf + (i - a) * record;
                        for (int k = 0; k < nparts; k++) {
                            memcpy(base[k] + slots[i] * bytes[k], rec, (size_t)bytes[k]);
                            rec += bytes[k];
                        }
                    }
                }
            }
        }
        free(buf);
        if (my_err) {
#pragma omp critical
            if (!err) err = my_err;
        }
    }
    free(start);
    /* Dirty store pages are bounded to one call's writes: under a memory cgroup they are charged
     * to the rank, and the kernel does not throttle a cgroup's dirtying, so a fill or a burst of
     * write-backs faster than the disk drove the cgroup into its OOM killer (seen at 1.5 GiB of
     * store under a 0.5 GiB cap). A write call starts the writeback of what it wrote and returns;
     * the next write call first waits for that writeback and drops the pages it cleaned. Clean
     * pages the reads bring in stay until the kernel reclaims them (a cgroup reclaims them first):
     * a record written back later may then find its page there instead of reading it again. */
    if (!err && write && sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0) err = -errno;
    return err;
}
