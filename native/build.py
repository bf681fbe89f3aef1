"""The build of feos._native, feosd's compiled module of kernel calls, and of feos._nghttp2 (the
node connections' HTTP/2 over libnghttp2, its section at the end): cffi's out-of-line API mode.

Everything feosd asks of the kernel that Python's standard library does not offer goes through
here, compiled against the system's own headers (no structure is declared by hand: cffi reads
their layout from the compiler). The normal install builds it (setup.py names this file in
`cffi_modules`); for a work tree without an install, `python native/build.py` builds it in place
(feos/_native.*.so, ignored by git). The typed face of it, the one place that turns a failed call
into OSError, is feos/native.py: nothing else imports feos._native.

The module has one section per concern, each a C source and its declarations: a section added
(ublk for the disk service, userfaultfd for hibernation's lazy memory) is a new pair in
SECTIONS.

Memory rule of the batch section: Python never hands the C side an address to keep. A batch is
one block that cffi allocates (ffi.new) and frees; every pointer into it is set by C, to memory
inside the same block; what Python gives a call (the bytes of an answer) is copied before the
call returns; every index and length Python passes is checked against the block's bounds.
The records' section reads what Python hands it (names, the records' bytes) during the call
only, and keeps nothing.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

from cffi import FFI

BATCH_MAX = 64  # datagrams one recvmmsg reads, answers one sendmmsg sends
SLOT = 65536  # a datagram's room: the most UDP carries, so nothing is ever cut

HEADERS = """
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* Python.h defines it already: setns, fallocate, recvmmsg */
#endif
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <stdio.h>   /* renameat */
#include <unistd.h>
#include <netinet/in.h>
#include <linux/falloc.h>
#include <linux/ublk_cmd.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
"""

# --- files and processes: flock, setns, the subreaper, hole punching --------------------------

PROCESS_CDEF = """
#define LOCK_SH ...
#define LOCK_EX ...
#define LOCK_UN ...
#define LOCK_NB ...
#define CLONE_NEWNET ...
#define CLONE_NEWNS ...
#define PR_SET_CHILD_SUBREAPER ...
#define PR_GET_CHILD_SUBREAPER ...
#define FALLOC_FL_KEEP_SIZE ...
#define FALLOC_FL_PUNCH_HOLE ...
int flock(int fd, int operation);
int setns(int fd, int nstype);
int feos_set_child_subreaper(int on);
int feos_is_child_subreaper(void);
int feos_fallocate(int fd, int mode, int64_t offset, int64_t len);
"""

PROCESS_SOURCE = """
static int feos_set_child_subreaper(int on)
{
    return prctl(PR_SET_CHILD_SUBREAPER, (unsigned long)(on != 0), 0UL, 0UL, 0UL);
}

static int feos_fallocate(int fd, int mode, int64_t offset, int64_t len)
{
    return fallocate(fd, mode, (off_t)offset, (off_t)len);
}

static int feos_is_child_subreaper(void)
{
    int on = 0;
    if (prctl(PR_GET_CHILD_SUBREAPER, (unsigned long)&on, 0UL, 0UL, 0UL) != 0)
        return -1;
    return on != 0;
}
"""

# --- datagrams by the batch: recvmmsg(2) and sendmmsg(2) -------------------------------------

BATCH_CDEF = f"""
#define FEOS_BATCH_MAX {BATCH_MAX}
#define FEOS_SLOT {SLOT}
struct feos_batch {{
    uint32_t lengths[{BATCH_MAX}];   /* datagram i's length, of the last read */
    uint32_t addrs[{BATCH_MAX}];     /* its source's IPv4 address, as written (0: not IPv4) */
    uint16_t ports[{BATCH_MAX}];     /* its source's port, in host order */
    uint32_t got;                    /* datagrams the last read got */
    uint32_t queued;                 /* answers queued for the next send */
    char data[{BATCH_MAX}][{SLOT}];  /* datagram i, of the last read */
    ...;
}};
int feos_batch_init(struct feos_batch *b, int fd, unsigned int size);
int feos_batch_recv(struct feos_batch *b);
int feos_batch_queue(struct feos_batch *b, unsigned int i, unsigned int id_bytes,
                     const char *wire, size_t n);
int feos_batch_send(struct feos_batch *b);
"""

BATCH_SOURCE = f"""
#define FEOS_BATCH_MAX {BATCH_MAX}
#define FEOS_SLOT {SLOT}

union feos_sockaddr {{
    struct sockaddr sa;
    struct sockaddr_in v4;
    struct sockaddr_in6 v6;
}};

struct feos_batch {{
    uint32_t lengths[FEOS_BATCH_MAX];
    uint32_t addrs[FEOS_BATCH_MAX];
    uint16_t ports[FEOS_BATCH_MAX];
    uint32_t got;
    uint32_t queued;
    char data[FEOS_BATCH_MAX][FEOS_SLOT];
    /* Not seen from Python: the kernel's headers, each pointing into this same block. */
    int fd;
    unsigned int size;
    unsigned int unsendable;          /* answers refused at queue time, for the next send */
    struct mmsghdr rmsgs[FEOS_BATCH_MAX];
    struct iovec riov[FEOS_BATCH_MAX];
    union feos_sockaddr rnames[FEOS_BATCH_MAX];
    struct mmsghdr smsgs[FEOS_BATCH_MAX];
    struct iovec siov[FEOS_BATCH_MAX];
    union feos_sockaddr snames[FEOS_BATCH_MAX]; /* a copy: a later read cannot redirect it */
    char out[FEOS_BATCH_MAX][FEOS_SLOT];
}};

/* Point every header at its own slot of the block. The block is zeroed by ffi.new. */
static int feos_batch_init(struct feos_batch *b, int fd, unsigned int size)
{{
    unsigned int i;
    if (size == 0 || size > FEOS_BATCH_MAX) {{
        errno = EINVAL;
        return -1;
    }}
    b->fd = fd;
    b->size = size;
    b->got = b->queued = b->unsendable = 0;
    for (i = 0; i < FEOS_BATCH_MAX; i++) {{
        b->riov[i].iov_base = b->data[i];
        b->riov[i].iov_len = FEOS_SLOT;
        b->siov[i].iov_base = b->out[i];
        b->siov[i].iov_len = 0;
    }}
    return 0;
}}

static void feos_batch_reset_reads(struct feos_batch *b)
{{
    unsigned int i;
    for (i = 0; i < b->size; i++) {{
        struct msghdr *h = &b->rmsgs[i].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &b->rnames[i];
        h->msg_namelen = sizeof b->rnames[i];
        h->msg_iov = &b->riov[i];
        h->msg_iovlen = 1;
        b->rmsgs[i].msg_len = 0;
    }}
}}

static void feos_batch_note_sources(struct feos_batch *b, unsigned int got)
{{
    unsigned int i;
    for (i = 0; i < got; i++) {{
        const union feos_sockaddr *name = &b->rnames[i];
        unsigned int len = b->rmsgs[i].msg_len;
        b->lengths[i] = len > FEOS_SLOT ? FEOS_SLOT : len;
        if (b->rmsgs[i].msg_hdr.msg_namelen >= sizeof name->v4 && name->sa.sa_family == AF_INET) {{
            b->addrs[i] = name->v4.sin_addr.s_addr;
            b->ports[i] = ntohs(name->v4.sin_port);
        }} else {{
            b->addrs[i] = 0;
            b->ports[i] = 0;
        }}
    }}
}}

/* Read up to a batch without waiting: how many (0: none waits), or -1 and errno. An error
   queued on the socket (an ICMP one) is no datagram: read on, at most `size` times. */
static int feos_batch_recv(struct feos_batch *b)
{{
    unsigned int tries;
    b->got = 0;
    for (tries = 0; tries < b->size; tries++) {{
        int got;
        feos_batch_reset_reads(b);
        got = recvmmsg(b->fd, b->rmsgs, b->size, MSG_DONTWAIT, NULL);
        if (got >= 0) {{
            feos_batch_note_sources(b, (unsigned int)got);
            b->got = (unsigned int)got;
            return got;
        }}
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return 0;
        if (errno == EBADF || errno == ENOTSOCK || errno == EFAULT || errno == EINVAL)
            return -1;
    }}
    return 0;
}}

/* Queue an answer to datagram i of the last read: its first id_bytes (0 or 2: the query's ID)
   and then n bytes of wire, copied now. 0, or -1 and errno (EINVAL: no such datagram;
   EMSGSIZE: more than a datagram holds, counted as unsendable; ENOBUFS: the batch is full). */
static int feos_batch_queue(struct feos_batch *b, unsigned int i, unsigned int id_bytes,
                            const char *wire, size_t n)
{{
    unsigned int k = b->queued;
    socklen_t namelen;
    struct msghdr *h;
    if (i >= b->got || id_bytes > 2 || id_bytes > b->lengths[i]) {{
        errno = EINVAL;
        return -1;
    }}
    if (n > FEOS_SLOT - id_bytes) {{
        b->unsendable++;
        errno = EMSGSIZE;
        return -1;
    }}
    if (k >= b->size) {{
        errno = ENOBUFS;
        return -1;
    }}
    memcpy(b->out[k], b->data[i], id_bytes);
    memcpy(b->out[k] + id_bytes, wire, n);
    b->siov[k].iov_len = id_bytes + n;
    memcpy(&b->snames[k], &b->rnames[i], sizeof b->snames[k]);
    h = &b->smsgs[k].msg_hdr;
    memset(h, 0, sizeof *h);
    h->msg_name = &b->snames[k];
    namelen = b->rmsgs[i].msg_hdr.msg_namelen;  /* the kernel's: may say more than it wrote */
    h->msg_namelen = namelen > sizeof b->snames[k] ? sizeof b->snames[k] : namelen;
    h->msg_iov = &b->siov[k];
    h->msg_iovlen = 1;
    b->queued = k + 1;
    return 0;
}}

/* Send what is queued, without waiting: how many answers were not sent (refused at queue time,
   refused by the kernel, or left when the socket's buffer filled: the clients retry). */
static int feos_batch_send(struct feos_batch *b)
{{
    unsigned int sent = 0, queued = b->queued;
    int failed = (int)b->unsendable;
    b->queued = b->unsendable = 0;
    while (sent < queued) {{
        int got = sendmmsg(b->fd, b->smsgs + sent, queued - sent, MSG_DONTWAIT);
        if (got > 0) {{
            sent += (unsigned int)got;
        }} else if (got == 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {{
            return failed + (int)(queued - sent);
        }} else {{
            failed++;  /* this one refused: the rest go on */
            sent++;
        }}
    }}
    return failed;
}}
"""

# --- records: a group commit in one call (feos/records.py) -----------------------------------

RECORDS_CDEF = """
int feos_commit_group(int dir_fd, int n, char **tmps, char **names, char **datas,
                      const int64_t *lens, int *errs);
"""

RECORDS_SOURCE = """
#define FEOS_COMMIT_CHUNK 64  /* temporary files open at once */

static int feos_dropped(int dir_fd, const char *tmp, int fd, int err)
{
    if (fd >= 0)
        close(fd);
    unlinkat(dir_fd, tmp, 0);
    return err;
}

/* A put's first step: its temporary file made, written, and its write-back started (so that a
   group's files go to the disk together). The open file, or -1 with *err set (file removed). */
static int feos_write_started(int dir_fd, const char *tmp, const char *data, int64_t len,
                              int *err)
{
    int64_t done = 0;
    int fd = openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    while (done < len) {
        ssize_t wrote = write(fd, data + done, (size_t)(len - done));
        if (wrote < 0 && errno == EINTR)
            continue;
        if (wrote < 0) {
            *err = feos_dropped(dir_fd, tmp, fd, errno);
            return -1;
        }
        done += wrote;
    }
    (void)sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);  /* a start only: fsync decides */
    *err = 0;
    return fd;
}

/* A put's second step: the file synced and closed. 0, or the errno (file removed). */
static int feos_synced(int dir_fd, const char *tmp, int fd)
{
    if (fsync(fd) != 0)
        return feos_dropped(dir_fd, tmp, fd, errno);
    if (close(fd) != 0)
        return feos_dropped(dir_fd, tmp, -1, errno);
    return 0;
}

/* The records' group commit, in one call (made without the GIL): change i is a put of lens[i]
   bytes at datas[i] (lens[i] >= 0) through the temporary file tmps[i], or a removal
   (lens[i] < 0); names are relative to dir_fd. First each put's file is written (the write-back
   of up to FEOS_COMMIT_CHUNK of them started at once) and synced, in order; then, in order, each
   put whose file was made is renamed over names[i] and each removal unlinks names[i] (one that
   is not there is no failure); then, if any change was applied, the directory is synced once.
   errs[i] is 0, or the errno of change i's failed step (its temporary file removed). Returns 0,
   or the errno of the directory's sync. */
static int feos_commit_group(int dir_fd, int n, char **tmps, char **names, char **datas,
                             const int64_t *lens, int *errs)
{
    int fds[FEOS_COMMIT_CHUNK];
    int i, first, applied = 0;
    for (first = 0; first < n; first += FEOS_COMMIT_CHUNK) {
        int last = n - first > FEOS_COMMIT_CHUNK ? first + FEOS_COMMIT_CHUNK : n;
        for (i = first; i < last; i++) {
            errs[i] = 0;
            fds[i - first] = lens[i] < 0 ? -1
                : feos_write_started(dir_fd, tmps[i], datas[i], lens[i], &errs[i]);
        }
        for (i = first; i < last; i++)
            if (fds[i - first] >= 0)
                errs[i] = feos_synced(dir_fd, tmps[i], fds[i - first]);
    }
    for (i = 0; i < n; i++) {
        if (errs[i] != 0)
            continue;
        if (lens[i] < 0) {
            if (unlinkat(dir_fd, names[i], 0) != 0 && errno != ENOENT) {
                errs[i] = errno;
                continue;
            }
        } else if (renameat(dir_fd, tmps[i], dir_fd, names[i]) != 0) {
            errs[i] = feos_dropped(dir_fd, tmps[i], -1, errno);
            continue;
        }
        applied++;
    }
    if (applied > 0 && fsync(dir_fd) != 0)
        return errno;
    return 0;
}
"""

# --- userfaultfd: a restored pod's memory served page by page (diskd, hibernation) ----------
#
# The handler's side of Firecracker's Uffd memory backend: the VMM makes the userfaultfd,
# registers its guest memory and hands the fd over; diskd reads its events (struct uffd_msg,
# read(2) on the fd) and resolves each fault by UFFDIO_COPY (the snapshot's bytes) or
# UFFDIO_ZEROPAGE. The addresses are the VMM's, never dereferenced here; the source bytes are
# read by the kernel during the call only (the memory rule). feos_uffd_open/api/register are
# the VMM's side, for tests that play it. pidfd_getfd takes a VMM's fd back after a restart of
# diskd (docs/disk.md, "Serving memory lazily").

UFFD_CDEF = """
#define UFFD_API ...
#define UFFD_EVENT_PAGEFAULT ...
#define UFFD_EVENT_FORK ...
#define UFFD_EVENT_REMAP ...
#define UFFD_EVENT_REMOVE ...
#define UFFD_EVENT_UNMAP ...
#define UFFD_PAGEFAULT_FLAG_WRITE ...
#define UFFD_FEATURE_EVENT_REMOVE ...
#define UFFD_FEATURE_EVENT_UNMAP ...
#define UFFDIO_REGISTER_MODE_MISSING ...
#define UFFDIO_COPY_MODE_DONTWAKE ...
#define UFFDIO_ZEROPAGE_MODE_DONTWAKE ...
struct uffd_msg { uint8_t event; ...; };
int feos_uffd_open(int flags);
int feos_uffd_api(int fd, uint64_t features, uint64_t *got_features, uint64_t *ioctls);
int feos_uffd_register(int fd, uint64_t start, uint64_t len, uint64_t mode, uint64_t *ioctls);
int feos_uffd_copy(int fd, uint64_t dst, const char *src, uint64_t len, uint64_t mode,
                   int64_t *copied);
int feos_uffd_zeropage(int fd, uint64_t start, uint64_t len, uint64_t mode, int64_t *zeroed);
int feos_uffd_wake(int fd, uint64_t start, uint64_t len);
int feos_uffd_decode(const char *raw, uint64_t *event, uint64_t *a, uint64_t *b);
int feos_pidfd_getfd(int pidfd, int targetfd);
"""

UFFD_SOURCE = """
/* A userfaultfd (the syscall; /dev/userfaultfd where the syscall is refused). */
static int feos_uffd_open(int flags)
{
    int fd = (int)syscall(SYS_userfaultfd, flags);
    if (fd >= 0 || (errno != EPERM && errno != ENOSYS))
        return fd;
    int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    if (dev < 0)
        return -1;
    fd = ioctl(dev, USERFAULTFD_IOC_NEW, flags);
    int err = errno;
    close(dev);
    errno = err;
    return fd;
}

static int feos_uffd_api(int fd, uint64_t features, uint64_t *got_features, uint64_t *ioctls)
{
    struct uffdio_api api = { .api = UFFD_API, .features = features };
    if (ioctl(fd, UFFDIO_API, &api) != 0)
        return -1;
    *got_features = api.features;
    *ioctls = api.ioctls;
    return 0;
}

static int feos_uffd_register(int fd, uint64_t start, uint64_t len, uint64_t mode,
                              uint64_t *ioctls)
{
    struct uffdio_register reg = { .range = { .start = start, .len = len }, .mode = mode };
    if (ioctl(fd, UFFDIO_REGISTER, &reg) != 0)
        return -1;
    *ioctls = reg.ioctls;
    return 0;
}

/* len bytes from src into the faulting process at dst: 0 (*copied = len), or -1 and errno
   with *copied the bytes copied before the failure (EEXIST: a page there is mapped already;
   EAGAIN: the mappings changed meanwhile, try again). */
static int feos_uffd_copy(int fd, uint64_t dst, const char *src, uint64_t len, uint64_t mode,
                          int64_t *copied)
{
    struct uffdio_copy copy = { .dst = dst, .src = (uint64_t)(uintptr_t)src, .len = len,
                                .mode = mode, .copy = 0 };
    int rc = ioctl(fd, UFFDIO_COPY, &copy);
    *copied = copy.copy > 0 ? copy.copy : 0;
    return rc;
}

static int feos_uffd_zeropage(int fd, uint64_t start, uint64_t len, uint64_t mode,
                              int64_t *zeroed)
{
    struct uffdio_zeropage zero = { .range = { .start = start, .len = len }, .mode = mode,
                                    .zeropage = 0 };
    int rc = ioctl(fd, UFFDIO_ZEROPAGE, &zero);
    *zeroed = zero.zeropage > 0 ? zero.zeropage : 0;
    return rc;
}

static int feos_uffd_wake(int fd, uint64_t start, uint64_t len)
{
    struct uffdio_range range = { .start = start, .len = len };
    return ioctl(fd, UFFDIO_WAKE, &range);
}

/* One struct uffd_msg (sizeof bytes at raw): its event, and its two arguments (a page fault:
   flags, address; a removal: start, end; a remap: from, to; an unmap: start, end). */
static int feos_uffd_decode(const char *raw, uint64_t *event, uint64_t *a, uint64_t *b)
{
    struct uffd_msg msg;
    memcpy(&msg, raw, sizeof msg);
    *event = msg.event;
    *a = *b = 0;
    switch (msg.event) {
    case UFFD_EVENT_PAGEFAULT:
        *a = msg.arg.pagefault.flags;
        *b = msg.arg.pagefault.address;
        break;
    case UFFD_EVENT_REMOVE:
    case UFFD_EVENT_UNMAP:
        *a = msg.arg.remove.start;
        *b = msg.arg.remove.end;
        break;
    case UFFD_EVENT_REMAP:
        *a = msg.arg.remap.from;
        *b = msg.arg.remap.to;
        break;
    case UFFD_EVENT_FORK:
        *a = msg.arg.fork.ufd;
        break;
    }
    return 0;
}

static int feos_pidfd_getfd(int pidfd, int targetfd)
{
    return (int)syscall(SYS_pidfd_getfd, pidfd, targetfd, 0);
}
"""

# --- ublk: the control and I/O commands of the ublk driver (<linux/ublk_cmd.h>) --------------
#
# Layouts and numbers only, as the kernel's header gives them (the "...;" lets cffi take every
# offset from the compiler): diskd's ublk data path would issue these through io_uring
# (URING_CMD) on /dev/ublk-control and /dev/ublkcN. This host has no ublk_drv, so the I/O loop
# is not built (docs/disk.md, "ublk"); tests/unit/test_native_ublk.py checks the layout.

UBLK_CDEF = """
#define UBLK_CMD_GET_QUEUE_AFFINITY ...
#define UBLK_CMD_GET_DEV_INFO ...
#define UBLK_CMD_ADD_DEV ...
#define UBLK_CMD_DEL_DEV ...
#define UBLK_CMD_START_DEV ...
#define UBLK_CMD_STOP_DEV ...
#define UBLK_CMD_SET_PARAMS ...
#define UBLK_CMD_GET_PARAMS ...
#define UBLK_CMD_START_USER_RECOVERY ...
#define UBLK_CMD_END_USER_RECOVERY ...
#define UBLK_IO_FETCH_REQ ...
#define UBLK_IO_COMMIT_AND_FETCH_REQ ...
#define UBLK_IO_NEED_GET_DATA ...
#define UBLK_IO_RES_OK ...
#define UBLK_IO_RES_NEED_GET_DATA ...
#define UBLK_IO_OP_READ ...
#define UBLK_IO_OP_WRITE ...
#define UBLK_IO_OP_FLUSH ...
#define UBLK_IO_OP_DISCARD ...
#define UBLK_IO_OP_WRITE_SAME ...
#define UBLK_IO_OP_WRITE_ZEROES ...
#define UBLK_IO_F_FUA ...
#define UBLK_PARAM_TYPE_BASIC ...
#define UBLK_PARAM_TYPE_DISCARD ...
#define UBLK_ATTR_VOLATILE_CACHE ...
struct ublksrv_ctrl_cmd { uint32_t dev_id; uint16_t queue_id; uint16_t len; uint64_t addr;
                          unsigned long long data[2]; ...; };
struct ublksrv_ctrl_dev_info { uint16_t nr_hw_queues; uint16_t queue_depth; uint16_t state;
                               uint32_t max_io_buf_bytes; uint32_t dev_id; int32_t ublksrv_pid;
                               uint64_t flags; uint64_t ublksrv_flags; ...; };
struct ublksrv_io_desc { uint32_t op_flags; uint32_t nr_sectors; uint64_t start_sector;
                         uint64_t addr; ...; };
struct ublksrv_io_cmd { uint16_t q_id; uint16_t tag; int32_t result; uint64_t addr; ...; };
struct ublk_param_basic { uint32_t attrs; uint8_t logical_bs_shift; uint8_t physical_bs_shift;
                          uint8_t io_opt_shift; uint8_t io_min_shift; uint32_t max_sectors;
                          uint32_t chunk_sectors; uint64_t dev_sectors;
                          uint64_t virt_boundary_mask; ...; };
struct ublk_param_discard { uint32_t discard_alignment; uint32_t discard_granularity;
                            uint32_t max_discard_sectors; uint32_t max_write_zeroes_sectors;
                            uint16_t max_discard_segments; ...; };
struct ublk_params { uint32_t len; uint32_t types; struct ublk_param_basic basic;
                     struct ublk_param_discard discard; ...; };
"""

UBLK_SOURCE = ""

SECTIONS = [(PROCESS_CDEF, PROCESS_SOURCE), (BATCH_CDEF, BATCH_SOURCE),
            (RECORDS_CDEF, RECORDS_SOURCE), (UBLK_CDEF, UBLK_SOURCE), (UFFD_CDEF, UFFD_SOURCE)]

ffibuilder = FFI()
ffibuilder.cdef("\n".join(cdef for cdef, _ in SECTIONS))
ffibuilder.set_source(
    "feos._native",
    HEADERS + "\n".join(source for _, source in SECTIONS),
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)


# --- feos._nghttp2: libnghttp2 for the node connections' HTTP/2 (feos/fleet/_nghttp2.py) -------
#
# A module of its own beside feos._native, so that a machine without libnghttp2's headers still
# builds feosd's kernel calls (the node connections then run over h2: feos/fleet/_nghttp2.py).
# The C glue keeps the per-byte work in C: each header is counted against the header list's cap
# here and only :method (is it POST) and :path reach Python, with the request's HEADERS frame
# (one call per request); only the frames the core acts on reach Python
# (a request's HEADERS, an END_STREAM, RST_STREAM, a PING's ACK, GOAWAY); an answer that ended
# while the peer's side is open is followed by RST_STREAM NO_ERROR here (RFC 9113 8.1). Memory:
# the session's user data is the feos_ng block Python allocated (ffi.new) and keeps alive as long
# as the session; `py` is a cffi handle of the Python core; what the callbacks hand Python (a
# header's value, a DATA chunk) is copied before they return.

NGHTTP2_CDEF = """
typedef struct nghttp2_session nghttp2_session;
typedef struct { size_t length; int32_t stream_id; uint8_t type; uint8_t flags; ...; }
    nghttp2_frame_hd;
typedef struct { nghttp2_frame_hd hd; uint32_t error_code; ...; } nghttp2_rst_stream;
typedef struct { nghttp2_frame_hd hd; uint8_t opaque_data[8]; } nghttp2_ping;
typedef struct { nghttp2_frame_hd hd; int32_t last_stream_id; uint32_t error_code;
                 uint8_t *opaque_data; size_t opaque_data_len; ...; } nghttp2_goaway;
typedef struct { nghttp2_frame_hd hd; int cat; ...; } nghttp2_headers;
typedef union { nghttp2_frame_hd hd; nghttp2_rst_stream rst_stream; nghttp2_ping ping;
                nghttp2_goaway goaway; nghttp2_headers headers; ...; } nghttp2_frame;
typedef struct { uint8_t *name; uint8_t *value; size_t namelen; size_t valuelen;
                 uint8_t flags; } nghttp2_nv;
typedef struct { int32_t settings_id; uint32_t value; } nghttp2_settings_entry;
#define NGHTTP2_DATA_FLAG_EOF ...
#define NGHTTP2_DATA_FLAG_NO_END_STREAM ...
#define NGHTTP2_ERR_DEFERRED ...
#define NGHTTP2_ERR_CALLBACK_FAILURE ...
#define NGHTTP2_ERR_BAD_CLIENT_MAGIC ...
#define NGHTTP2_ERR_FLOODED ...
#define NGHTTP2_FLAG_END_STREAM ...
#define NGHTTP2_FLAG_ACK ...
#define NGHTTP2_HEADERS ...
#define NGHTTP2_DATA ...
#define NGHTTP2_RST_STREAM ...
#define NGHTTP2_PING ...
#define NGHTTP2_GOAWAY ...
#define NGHTTP2_SETTINGS ...
#define NGHTTP2_HCAT_REQUEST ...
#define NGHTTP2_HCAT_RESPONSE ...
#define NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS ...
#define NGHTTP2_SETTINGS_MAX_FRAME_SIZE ...
#define NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE ...
#define NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE ...
#define NGHTTP2_SETTINGS_ENABLE_PUSH ...

struct feos_ng {
    nghttp2_session *session;
    void *py;               /* the core's handle (ffi.new_handle) */
    size_t header_bytes;    /* the header block being decoded: each field's size plus 32 */
    size_t max_header_list;
    int over;               /* a header list went over max_header_list */
    int client;             /* the client's side (tests/fleet_ngclient.py) */
    int32_t drained_at;     /* the drain's last stream id; -1 before the drain */
    ...;
};
int feos_ng_new(struct feos_ng *ng, void *py, uint32_t max_header_list, int client);
void feos_ng_del(struct feos_ng *ng);
int feos_ng_respond(struct feos_ng *ng, int32_t stream_id, const nghttp2_nv *nva, size_t n,
                    int with_body);
int32_t feos_ng_request(struct feos_ng *ng, const nghttp2_nv *nva, size_t n, int with_body);
uint32_t nghttp2_session_get_remote_settings(nghttp2_session *, int);

int nghttp2_submit_settings(nghttp2_session *, uint8_t, const nghttp2_settings_entry *, size_t);
int nghttp2_session_set_local_window_size(nghttp2_session *, uint8_t, int32_t, int32_t);
ssize_t nghttp2_session_mem_recv(nghttp2_session *, const uint8_t *, size_t);
ssize_t nghttp2_session_mem_send(nghttp2_session *, const uint8_t **);
int nghttp2_submit_trailer(nghttp2_session *, int32_t, const nghttp2_nv *, size_t);
int nghttp2_submit_rst_stream(nghttp2_session *, uint8_t, int32_t, uint32_t);
int nghttp2_submit_ping(nghttp2_session *, uint8_t, const uint8_t *);
int nghttp2_submit_goaway(nghttp2_session *, uint8_t, int32_t, uint32_t, const uint8_t *,
                          size_t);
int nghttp2_session_resume_data(nghttp2_session *, int32_t);
int32_t nghttp2_session_get_last_proc_stream_id(nghttp2_session *);
int nghttp2_session_terminate_session(nghttp2_session *, uint32_t);
const char *nghttp2_strerror(int);

extern "Python" int feos_ng_on_request(void *, const nghttp2_frame *, int, const uint8_t *,
                                       size_t);
extern "Python" int feos_ng_on_field(void *, int32_t, const uint8_t *, size_t, const uint8_t *,
                                     size_t);
extern "Python" int feos_ng_on_frame(void *, const nghttp2_frame *);
extern "Python" int feos_ng_on_data(void *, int32_t, const uint8_t *, size_t);
extern "Python" int feos_ng_on_close(void *, int32_t, uint32_t);
extern "Python" int feos_ng_on_goaway_sent(void *, const nghttp2_frame *);
extern "Python" int feos_ng_on_error(void *, int, const char *, size_t);
extern "Python" int feos_ng_on_late(void *, int32_t);
extern "Python" ssize_t feos_ng_read(void *, int32_t, uint8_t *, size_t, uint32_t *);
"""

NGHTTP2_SOURCE = r"""
#include <nghttp2/nghttp2.h>

#define FEOS_NG_PATH_MAX 16384  /* a longer :path is over the header list's cap (16 KiB) too */

struct feos_ng {
    nghttp2_session *session;
    void *py;
    size_t header_bytes;
    size_t max_header_list;
    int over;
    int client;
    int32_t drained_at;
    int post;                   /* the request being decoded: its :method is POST */
    size_t path_len;            /* and its :path */
    uint8_t path[FEOS_NG_PATH_MAX];
};

static int feos_ng_on_request(void *, const nghttp2_frame *, int, const uint8_t *, size_t);
static int feos_ng_on_field(void *, int32_t, const uint8_t *, size_t, const uint8_t *, size_t);
static int feos_ng_on_frame(void *, const nghttp2_frame *);
static int feos_ng_on_data(void *, int32_t, const uint8_t *, size_t);
static int feos_ng_on_close(void *, int32_t, uint32_t);
static int feos_ng_on_goaway_sent(void *, const nghttp2_frame *);
static int feos_ng_on_error(void *, int, const char *, size_t);
static int feos_ng_on_late(void *, int32_t);
static ssize_t feos_ng_read(void *, int32_t, uint8_t *, size_t, uint32_t *);

static int ng_begin_headers(nghttp2_session *s, const nghttp2_frame *frame, void *ud)
{
    struct feos_ng *ng = ud;
    ng->header_bytes = 0;
    ng->post = 0;
    ng->path_len = 0;
    return 0;
}

/* A request that comes after the drain's GOAWAY: libnghttp2 ignores it without a word; the
   core refuses it (RST_STREAM REFUSED_STREAM, once libnghttp2 has seen its id), as h2's does. */
static int ng_begin_frame(nghttp2_session *s, const nghttp2_frame_hd *hd, void *ud)
{
    struct feos_ng *ng = ud;
    if (ng->drained_at >= 0 && hd->type == NGHTTP2_HEADERS && (hd->stream_id & 1)
        && hd->stream_id > ng->drained_at
        && nghttp2_session_find_stream(s, hd->stream_id) == NULL)
        return feos_ng_on_late(ng->py, hd->stream_id);
    return 0;
}

static int ng_header(nghttp2_session *s, const nghttp2_frame *frame, const uint8_t *name,
                     size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags,
                     void *ud)
{
    struct feos_ng *ng = ud;
    ng->header_bytes += namelen + valuelen + 32;
    if (ng->header_bytes > ng->max_header_list || valuelen > FEOS_NG_PATH_MAX) {
        ng->over = 1;
        return NGHTTP2_ERR_CALLBACK_FAILURE;  /* the connection's end: ENHANCE_YOUR_CALM */
    }
    if (ng->client)  /* an answer's headers and trailers: all of them */
        return feos_ng_on_field(ng->py, frame->hd.stream_id, name, namelen, value, valuelen);
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST)
        return 0;  /* the peer's trailers: nothing the core reads */
    /* kept for the request's one call into Python (ng_frame_recv) */
    if (namelen == 7 && memcmp(name, ":method", 7) == 0)
        ng->post = valuelen == 4 && memcmp(value, "POST", 4) == 0;
    else if (namelen == 5 && memcmp(name, ":path", 5) == 0) {
        memcpy(ng->path, value, valuelen);
        ng->path_len = valuelen;
    }
    return 0;
}

static int ng_frame_recv(nghttp2_session *s, const nghttp2_frame *frame, void *ud)
{
    struct feos_ng *ng = ud;
    switch (frame->hd.type) {
    case NGHTTP2_HEADERS:
        ng->header_bytes = 0;
        if (!ng->client && frame->headers.cat == NGHTTP2_HCAT_REQUEST)
            return feos_ng_on_request(ng->py, frame, ng->post, ng->path, ng->path_len);
        return feos_ng_on_frame(ng->py, frame);
    case NGHTTP2_DATA:
        if (frame->hd.flags & NGHTTP2_FLAG_END_STREAM)
            return feos_ng_on_frame(ng->py, frame);
        return 0;
    case NGHTTP2_PING:
        if ((frame->hd.flags & NGHTTP2_FLAG_ACK) || ng->client)
            return feos_ng_on_frame(ng->py, frame);
        return 0;
    case NGHTTP2_RST_STREAM:
    case NGHTTP2_GOAWAY:
        return feos_ng_on_frame(ng->py, frame);
    case NGHTTP2_SETTINGS:
        if (ng->client && !(frame->hd.flags & NGHTTP2_FLAG_ACK))
            return feos_ng_on_frame(ng->py, frame);
        return 0;
    }
    return 0;
}

static int ng_data_chunk(nghttp2_session *s, uint8_t flags, int32_t stream_id,
                         const uint8_t *data, size_t len, void *ud)
{
    return feos_ng_on_data(((struct feos_ng *)ud)->py, stream_id, data, len);
}

static int ng_stream_close(nghttp2_session *s, int32_t stream_id, uint32_t code, void *ud)
{
    return feos_ng_on_close(((struct feos_ng *)ud)->py, stream_id, code);
}

static int ng_frame_send(nghttp2_session *s, const nghttp2_frame *frame, void *ud)
{
    struct feos_ng *ng = ud;
    if (frame->hd.type == NGHTTP2_GOAWAY)
        return feos_ng_on_goaway_sent(ng->py, frame);
    if (!ng->client
        && (frame->hd.type == NGHTTP2_DATA || frame->hd.type == NGHTTP2_HEADERS)
        && (frame->hd.flags & NGHTTP2_FLAG_END_STREAM)
        && nghttp2_session_get_stream_remote_close(s, frame->hd.stream_id) == 0)
        /* the answer ended before the request did: the rest of its upload stopped */
        return nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, frame->hd.stream_id,
                                         NGHTTP2_NO_ERROR) == 0 ? 0
                                                                : NGHTTP2_ERR_CALLBACK_FAILURE;
    return 0;
}

static int ng_error(nghttp2_session *s, int code, const char *msg, size_t len, void *ud)
{
    return feos_ng_on_error(((struct feos_ng *)ud)->py, code, msg, len);
}

static ssize_t ng_read(nghttp2_session *s, int32_t stream_id, uint8_t *buf, size_t length,
                       uint32_t *data_flags, nghttp2_data_source *source, void *ud)
{
    return feos_ng_read(((struct feos_ng *)ud)->py, stream_id, buf, length, data_flags);
}

static int feos_ng_new(struct feos_ng *ng, void *py, uint32_t max_header_list, int client)
{
    nghttp2_session_callbacks *cb;
    nghttp2_option *opt;
    int rv = nghttp2_session_callbacks_new(&cb);
    if (rv != 0)
        return rv;
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, ng_begin_headers);
    nghttp2_session_callbacks_set_on_begin_frame_callback(cb, ng_begin_frame);
    nghttp2_session_callbacks_set_on_header_callback(cb, ng_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, ng_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, ng_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, ng_stream_close);
    nghttp2_session_callbacks_set_on_frame_send_callback(cb, ng_frame_send);
    nghttp2_session_callbacks_set_error_callback2(cb, ng_error);
    rv = nghttp2_option_new(&opt);
    if (rv != 0) {
        nghttp2_session_callbacks_del(cb);
        return rv;
    }
    ng->py = py;
    ng->header_bytes = 0;
    ng->max_header_list = max_header_list;
    ng->over = 0;
    ng->client = client;
    ng->drained_at = -1;
    if (client)
        rv = nghttp2_session_client_new2(&ng->session, cb, ng, opt);
    else
        rv = nghttp2_session_server_new2(&ng->session, cb, ng, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cb);
    return rv;
}

static void feos_ng_del(struct feos_ng *ng)
{
    if (ng->session != NULL)
        nghttp2_session_del(ng->session);
    ng->session = NULL;
}

/* An answer's HEADERS, and its DATA pulled from the core (feos_ng_read) when with_body. */
static int feos_ng_respond(struct feos_ng *ng, int32_t stream_id, const nghttp2_nv *nva,
                           size_t n, int with_body)
{
    nghttp2_data_provider provider;
    provider.source.ptr = NULL;
    provider.read_callback = ng_read;
    return nghttp2_submit_response(ng->session, stream_id, nva, n,
                                   with_body ? &provider : NULL);
}

/* The client's request (the stream's id, or an error); its body pulled as an answer's. */
static int32_t feos_ng_request(struct feos_ng *ng, const nghttp2_nv *nva, size_t n,
                               int with_body)
{
    nghttp2_data_provider provider;
    provider.source.ptr = NULL;
    provider.read_callback = ng_read;
    return nghttp2_submit_request(ng->session, NULL, nva, n, with_body ? &provider : NULL,
                                  NULL);
}
"""

nghttp2_builder = FFI()
nghttp2_builder.cdef(NGHTTP2_CDEF)
nghttp2_builder.set_source(
    "feos._nghttp2",
    "#include <stdint.h>\n#include <string.h>\n#include <sys/types.h>\n" + NGHTTP2_SOURCE,
    libraries=["nghttp2"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)


def build_in_place() -> list[pathlib.Path]:
    """Compile into build/native and copy the modules beside feos/'s sources. feos._nghttp2
    is left out (with a line saying why) where libnghttp2's headers are missing."""
    root = pathlib.Path(__file__).resolve().parent.parent
    work = root / "build" / "native"
    work.mkdir(parents=True, exist_ok=True)
    built = [_place(root, "_native", work / ffibuilder.compile(tmpdir=str(work)))]
    if not pathlib.Path("/usr/include/nghttp2/nghttp2.h").exists():
        print("feos._nghttp2 not built: no /usr/include/nghttp2/nghttp2.h (libnghttp2-dev); "
              "the node connections run over h2", file=sys.stderr)
        return built
    built.append(_place(root, "_nghttp2", work / nghttp2_builder.compile(tmpdir=str(work))))
    return built


def _place(root: pathlib.Path, name: str, built: pathlib.Path) -> pathlib.Path:
    # cffi's C is Python's limited API: the name the install gives it, which nothing shadows
    target = root / "feos" / f"{name}.abi3.so"
    for other in target.parent.glob(f"{name}.*.so"):
        if other != target:
            other.unlink()  # another build's, which Python would load before this one
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(built, tmp)
    tmp.replace(target)  # a process that has the old one mapped keeps it
    return target


if __name__ == "__main__":
    for path in build_in_place():
        print(path, file=sys.stderr)
