/* This machine's latency floor for bench.py: an 8-byte TCP ping-pong over 127.0.0.1 in C.
 * Usage: floor poll|block|hop ROUND_TRIPS WARMUP. The parent pings, a forked child echoes;
 * "poll": both ends spin on non-blocking reads, yielding the CPU every 64 tries (so two
 * spinners on one CPU take turns, not time slices); "block": both ends block in read;
 * "hop": at each end a progress thread blocks in read and hands each message to the
 * waiting main thread through an eventfd (what a progress thread per device costs a
 * message, against "block": run to completion in the waiter).
 * Prints: mode=M round_trips=N median_half_rtt_ns=T (half the median round trip)
 * cpu_ns_per_message=C (the CPU time, user and system, of both ends over the whole run,
 * warm-up included, per message one end took in and answered: what a process that only
 * waits, receives and answers costs a message here, with no work of its own). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) { perror(what); exit(1); }

static long long now_ns(void) {
	struct timespec t;
	if (clock_gettime(CLOCK_MONOTONIC, &t) != 0) die("floor: clock_gettime");
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Send or receive exactly 8 bytes; a polling receive gives up after 10 s without them. */
static void move8(int fd, char *buf, int sending, int poll) {
	long long deadline = now_ns() + 10000000000LL;
	unsigned long spins = 0;
	for (size_t done = 0; done < 8;) {
		ssize_t n = sending ? send(fd, buf + done, 8 - done, MSG_NOSIGNAL)
				    : recv(fd, buf + done, 8 - done, poll ? MSG_DONTWAIT : 0);
		if (n > 0) { done += (size_t)n; continue; }
		if (n == 0) { fputs("floor: the peer closed the connection\n", stderr); exit(1); }
		if (errno == EINTR) continue;
		if (!poll || sending || (errno != EAGAIN && errno != EWOULDBLOCK))
			die(sending ? "floor: send" : "floor: recv");
		if (++spins % 64 == 0 && sched_yield() != 0) die("floor: sched_yield");
		if (spins % 4096 == 0 && now_ns() > deadline) {
			fputs("floor: no answer in 10 s\n", stderr);
			exit(1);
		}
	}
}

/* "hop": the progress thread of one end. It reads each 8-byte message and tells the main
 * thread through the eventfd; it ends quietly at the peer's FIN. */
struct hop {
	int fd, efd;
};

static void *progress(void *arg) {
	const struct hop *h = arg;
	char buf[8];
	for (;;) {
		for (size_t done = 0; done < 8;) {
			ssize_t n = recv(h->fd, buf + done, 8 - done, 0);
			if (n == 0) return NULL;
			if (n < 0 && errno != EINTR) die("floor: recv (progress thread)");
			if (n > 0) done += (size_t)n;
		}
		uint64_t one = 1;
		if (write(h->efd, &one, sizeof one) != sizeof one) die("floor: eventfd write");
	}
}

/* "hop": wait until the progress thread has a message. */
static void hop_wait(int efd) {
	uint64_t k;
	while (read(efd, &k, sizeof k) != sizeof k)
		if (errno != EINTR) die("floor: eventfd read");
}

/* A count 0..1e7 from the command line, or -1. */
static long count(const char *s) {
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	return errno || end == s || *end || v < 0 || v > 10000000 ? -1 : v;
}

static int cmp(const void *a, const void *b) {
	long long x = *(const long long *)a, y = *(const long long *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv) {
	long n = argc == 4 ? count(argv[2]) : 0, warm = argc == 4 ? count(argv[3]) : -1;
	int poll = argc == 4 && strcmp(argv[1], "poll") == 0, one = 1, fd;
	int hop = argc == 4 && strcmp(argv[1], "hop") == 0;
	if (argc != 4 || (!poll && !hop && strcmp(argv[1], "block") != 0) || n < 1 || warm < 0) {
		fputs("usage: floor poll|block|hop ROUND_TRIPS(1..1e7) WARMUP(0..1e7)\n", stderr);
		return 2;
	}
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t alen = sizeof a;
	int lis = socket(AF_INET, SOCK_STREAM, 0);
	if (lis < 0 || bind(lis, (struct sockaddr *)&a, sizeof a) != 0 || listen(lis, 1) != 0 ||
	    getsockname(lis, (struct sockaddr *)&a, &alen) != 0) die("floor: listen on 127.0.0.1");
	pid_t child = fork();
	if (child < 0) die("floor: fork");
	if (child == 0) {
		fd = socket(AF_INET, SOCK_STREAM, 0);
		if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) die("floor: connect");
	} else if ((fd = accept(lis, NULL, NULL)) < 0) die("floor: accept");
	if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) die("floor: TCP_NODELAY");
	long long *rtt = malloc((size_t)n * sizeof *rtt);
	char buf[8] = {0};
	if (rtt == NULL) die("floor: malloc");
	struct hop h = {fd, hop ? eventfd(0, 0) : -1};
	pthread_t thread;
	if (hop && (h.efd < 0 || pthread_create(&thread, NULL, progress, &h) != 0))
		die("floor: the progress thread");
	for (long i = 0; i < warm + n; i++) {
		long long t = now_ns();
		if (hop) { /* the parent pings first, the child echoes; each receives in its thread */
			if (child != 0) move8(fd, buf, 1, 0);
			hop_wait(h.efd);
			if (child == 0) move8(fd, buf, 1, 0);
		} else {
			move8(fd, buf, child != 0, poll);
			move8(fd, buf, child == 0, poll);
		}
		if (child != 0 && i >= warm) rtt[i - warm] = now_ns() - t;
	}
	if (child == 0) return 0;
	int status;
	if (waitpid(child, &status, 0) != child) die("floor: waitpid");
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { fputs("floor: the echo failed\n", stderr); return 1; }
	qsort(rtt, (size_t)n, sizeof *rtt, cmp);
	long long median = n % 2 ? rtt[n / 2] : (rtt[n / 2 - 1] + rtt[n / 2]) / 2;
	long long cpu = 0;
	struct rusage ru;
	for (int who = 0; who < 2; who++) {
		if (getrusage(who ? RUSAGE_CHILDREN : RUSAGE_SELF, &ru) != 0) die("floor: getrusage");
		cpu += (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000000LL +
		       (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1000LL;
	}
	printf("mode=%s round_trips=%ld median_half_rtt_ns=%lld cpu_ns_per_message=%lld\n", argv[1],
	       n, median / 2, cpu / (2 * (warm + n)));
	return 0;
}
