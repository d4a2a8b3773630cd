/* nfq_delay: a delay line in the packet path, for the link benchmark (benchmarks/netlink.py).
 *
 * Every packet that an iptables NFQUEUE rule sends to queue QUEUE is held for DELAY_US
 * microseconds after it reached this program, then accepted (re-injected where it left the
 * kernel's path). The packet stays in the kernel: only its id crosses to user space (copy mode
 * META, no payload), and GSO packets are queued whole (NFQA_CFG_F_GSO). The delay is the same
 * for every packet, so the packets due are always the oldest ones: one batch verdict ("accept
 * every id up to N") releases them in order.
 *
 *   gcc -O2 -o nfq_delay nfq_delay.c -lnetfilter_queue -lnfnetlink
 *   nfq_delay QUEUE DELAY_US [--fifo]     (root; --fifo: SCHED_FIFO, so that a busy machine
 *                                          does not stretch the delay)
 *
 * It prints "ready" once bound, and on SIGTERM/SIGINT prints one line of counters (packets; how
 * late after their due time they were released: mean, max, how many by more than 1 ms) and exits.
 * Needs libnetfilter-queue (Debian: libnetfilter-queue-dev).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <arpa/inet.h>
#include <linux/netfilter.h>
#include <linux/netlink.h>
#include <libnetfilter_queue/libnetfilter_queue.h>

#define RING (1u << 20) /* packets held at most; the kernel queue is sized to match */

static uint32_t ids[RING];
static int64_t due_ns[RING];
static uint32_t head, tail; /* held: [head, tail) */
static int64_t delay_ns;
static volatile sig_atomic_t stop;
static unsigned long long n_packets, n_overflow, n_verdicts, n_late_1ms;
static int64_t max_late_ns, sum_late_ns;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)msg;
    (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (ph == NULL)
        return 0;
    uint32_t id = ntohl(ph->packet_id);
    n_packets++;
    if (tail - head >= RING) { /* cannot hold it: pass it on now rather than lose it */
        n_overflow++;
        return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    }
    ids[tail % RING] = id;
    due_ns[tail % RING] = now_ns() + delay_ns;
    tail++;
    return 0;
}

static void release_due(struct nfq_q_handle *qh) {
    int64_t now = now_ns();
    uint32_t last = head;
    while (last != tail && due_ns[last % RING] <= now) {
        int64_t late = now - due_ns[last % RING]; /* released this long after it was due */
        sum_late_ns += late;
        n_late_1ms += late > 1000000;
        if (late > max_late_ns)
            max_late_ns = late;
        last++;
    }
    if (last != head) {
        nfq_set_verdict_batch(qh, ids[(last - 1) % RING], NF_ACCEPT);
        n_verdicts++;
        head = last;
    }
}

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s QUEUE DELAY_US [--fifo]\n", argv[0]);
        return 2;
    }
    int queue = atoi(argv[1]);
    delay_ns = (int64_t)(atof(argv[2]) * 1000.0);
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* wake up on time, not up to 50 us late */
    if (argc > 3 && strcmp(argv[3], "--fifo") == 0) {
        struct sched_param sp = {.sched_priority = 10};
        if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0)
            fprintf(stderr, "nfq_delay: SCHED_FIFO: %s (going on without it)\n", strerror(errno));
    }
    struct nfq_handle *h = nfq_open();
    if (h == NULL) {
        fprintf(stderr, "nfq_delay: nfq_open: %s\n", strerror(errno));
        return 1;
    }
    struct nfq_q_handle *qh = nfq_create_queue(h, (uint16_t)queue, on_packet, NULL);
    if (qh == NULL) {
        fprintf(stderr, "nfq_delay: nfq_create_queue %d: %s\n", queue, strerror(errno));
        return 1;
    }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0 || nfq_set_queue_maxlen(qh, RING) < 0 ||
        nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0) {
        fprintf(stderr, "nfq_delay: configuring queue %d: %s\n", queue, strerror(errno));
        return 1;
    }
    int fd = nfq_fd(h);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 16 * 1024 * 1024);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    printf("ready\n");
    fflush(stdout);

    static char buf[65536];
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    while (!stop) {
        struct timespec wait, *timeout = NULL;
        if (head != tail) {
            int64_t left = due_ns[head % RING] - now_ns();
            if (left < 0)
                left = 0;
            wait.tv_sec = left / 1000000000;
            wait.tv_nsec = left % 1000000000;
            timeout = &wait;
        }
        int ready = ppoll(&pfd, 1, timeout, NULL);
        if (ready < 0 && errno != EINTR) {
            fprintf(stderr, "nfq_delay: ppoll: %s\n", strerror(errno));
            break;
        }
        if (ready > 0) {
            for (;;) { /* everything waiting, without blocking */
                ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
                if (n <= 0)
                    break;
                nfq_handle_packet(h, buf, (int)n);
            }
        }
        release_due(qh);
    }
    /* let what is still held through, then go: the queue is unbound on close */
    if (head != tail)
        nfq_set_verdict_batch(qh, ids[(tail - 1) % RING], NF_ACCEPT);
    printf("packets %llu overflow %llu verdicts %llu mean_late_us %.1f max_late_us %.1f late_over_1ms %llu\n", n_packets,
           n_overflow, n_verdicts, n_packets ? sum_late_ns / 1000.0 / (double)n_packets : 0.0, max_late_ns / 1000.0,
           n_late_1ms);
    fflush(stdout);
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}
