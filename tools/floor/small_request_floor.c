/* The floor of a small request on the machine at hand: kvxfer's shape with nothing else, in C.
 *
 * Two processes over loopback tcp. The "prefill" sends each request as one sendmsg: a header, the
 * run table (one 8-byte destination offset per page), the pages (scattered in a 16 MiB region,
 * their Adler-32 taken before the send) and a DONE carrying that sum; then it waits for a 4-byte
 * RESULT before the next request, and sleeps 200 us (the vCPUs go idle between requests, as in
 * `kvxfer bench --small-requests`). The "decode"'s receiving thread reads the header, the run
 * table and each page into place, sums what landed, compares it with DONE, wakes a consumer thread
 * through a condition variable (mode 0) or lets it find the count on its next 50 us poll (mode 1,
 * as the bench's NIXL target polls), and sends RESULT. Latency: the prefill's clock before its
 * send to the consumer's after its wake (CLOCK_MONOTONIC, shared by both processes). No checks of
 * kvxfer's (admission, write guard, ledger, verification beyond the sum) and no control plane.
 *
 * Build and run (docs/benchmarks.md, small requests):
 *   gcc -O2 -o /tmp/small_request_floor tools/floor/small_request_floor.c -lz -lpthread
 *   /tmp/small_request_floor REQUESTS MODE PINNED PAGES PAGE_BYTES
 * e.g. `/tmp/small_request_floor 3000 0 1 1 4096`. PINNED=1 puts the prefill on CPU 0 and the decode
 * on CPU 1 (as `--pin`). Prints one line: p50 and p99 in microseconds. Exit 1 if a sum disagreed.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define REGION (16u << 20)
#define MAX_PAGES 64

struct header { uint32_t kind, slot, gen, pages; };
struct done { uint32_t gen, sum; uint64_t bytes; };

static double *stamps;  /* shared: stamps[2i] sent, stamps[2i+1] consumed */
static int requests, mode;
static atomic_int landed;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static int read_exact(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n) {
    ssize_t got = recv(fd, p, n, 0);
    if (got <= 0) return -1;
    p += got;
    n -= (size_t)got;
  }
  return 0;
}

static void *consumer(void *unused) {
  (void)unused;
  for (int i = 0; i < requests; i++) {
    if (mode == 0) {
      pthread_mutex_lock(&lock);
      while (atomic_load(&landed) <= i) pthread_cond_wait(&changed, &lock);
      pthread_mutex_unlock(&lock);
    } else {
      struct timespec pause = {0, 50000};
      while (atomic_load(&landed) <= i) nanosleep(&pause, NULL);
    }
    stamps[2 * i + 1] = now_us();
  }
  return NULL;
}

static int decode(int listener, char *region, size_t page_bytes) {
  int conn = accept(listener, NULL, NULL), one = 1;
  setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  pthread_t thread;
  pthread_create(&thread, NULL, consumer, NULL);
  for (int i = 0; i < requests; i++) {
    struct header h;
    uint64_t offsets[MAX_PAGES];
    struct done d;
    if (read_exact(conn, &h, sizeof h) || h.pages > MAX_PAGES || read_exact(conn, offsets, 8 * h.pages)) return 1;
    uLong sum = adler32(0, NULL, 0);
    for (uint32_t k = 0; k < h.pages; k++) {
      if (offsets[k] + page_bytes > REGION || read_exact(conn, region + offsets[k], page_bytes)) return 1;
      sum = adler32(sum, (const Bytef *)region + offsets[k], (uInt)page_bytes);
    }
    if (read_exact(conn, &d, sizeof d) || d.sum != sum || d.gen != h.gen) {
      fprintf(stderr, "request %d: DONE disagrees with what landed\n", i);
      return 1;
    }
    pthread_mutex_lock(&lock);
    atomic_fetch_add(&landed, 1);
    pthread_cond_signal(&changed);
    pthread_mutex_unlock(&lock);
    uint32_t result = d.gen;
    if (send(conn, &result, sizeof result, 0) != sizeof result) return 1;
  }
  pthread_join(thread, NULL);
  return 0;
}

static int compare(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s REQUESTS MODE(0 wake|1 poll) PINNED(0|1) PAGES(1-%d) PAGE_BYTES\n", argv[0], MAX_PAGES);
    return 2;
  }
  requests = atoi(argv[1]);
  mode = atoi(argv[2]);
  int pinned = atoi(argv[3]), pages = atoi(argv[4]);
  size_t page_bytes = strtoul(argv[5], NULL, 10);
  if (requests < 1 || pages < 1 || pages > MAX_PAGES || page_bytes < 64 || page_bytes > REGION / MAX_PAGES) {
    fprintf(stderr, "REQUESTS must be at least 1, PAGES 1-%d and PAGE_BYTES 64-%u\n", MAX_PAGES, REGION / MAX_PAGES);
    return 2;
  }
  stamps = mmap(NULL, sizeof(double) * 2 * requests, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof addr;
  if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1) ||
      getsockname(listener, (struct sockaddr *)&addr, &len)) return 1;
  char *region = malloc(REGION);
  memset(region, 7, REGION);
  pid_t parent = getpid(), child = fork();
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* dies with the prefill, even while waiting in accept */
    if (getppid() != parent) _exit(1);
    if (pinned) pin(1);
    _exit(decode(listener, region, page_bytes));
  }
  if (pinned) pin(0);
  int sock = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  if (connect(sock, (struct sockaddr *)&addr, sizeof addr)) return 1;
  setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  srand(1);
  size_t slots = REGION / page_bytes;
  for (int i = 0; i < requests; i++) {
    stamps[2 * i] = now_us();
    struct header h = {1, 3, (uint32_t)i, (uint32_t)pages};
    uint64_t offsets[MAX_PAGES];
    struct iovec iov[MAX_PAGES + 3];
    int n = 0;
    iov[n++] = (struct iovec){&h, sizeof h};
    iov[n++] = (struct iovec){offsets, 8 * (size_t)pages};
    uLong sum = adler32(0, NULL, 0);
    for (int k = 0; k < pages; k++) {
      offsets[k] = (uint64_t)((size_t)rand() % slots) * page_bytes;
      iov[n++] = (struct iovec){region + offsets[k], page_bytes};
      sum = adler32(sum, (const Bytef *)region + offsets[k], (uInt)page_bytes);
    }
    struct done d = {(uint32_t)i, (uint32_t)sum, (uint64_t)page_bytes * (uint64_t)pages};
    iov[n++] = (struct iovec){&d, sizeof d};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    uint32_t result;
    if (sendmsg(sock, &msg, 0) < 0 || read_exact(sock, &result, sizeof result)) break;
    usleep(200);
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status)) return 1;
  double *lat = malloc(sizeof(double) * requests);
  for (int i = 0; i < requests; i++) lat[i] = stamps[2 * i + 1] - stamps[2 * i];
  qsort(lat, requests, sizeof *lat, compare);
  printf("c %s pinned %d, %d page(s) of %zu B: p50 %.1f us p99 %.1f us\n", mode ? "poll" : "wake", pinned, pages,
         page_bytes, lat[requests / 2], lat[requests * 99 / 100]);
  return 0;
}
