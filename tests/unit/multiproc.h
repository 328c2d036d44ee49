// Runs one function per rank in forked child processes, as the tests' stand-in for a launcher.
// The parent waits with a deadline, kills stragglers, and returns each rank's exit code
// (128 + signal for a rank killed by a signal, -1 for one that outlived the deadline).
// `reaped`, when given, is called with each child's pid once all of them are gone (to clean up what they left
// behind; not earlier, since a survivor may still reach into what a dead rank left).
#pragma once
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

// Inside a rank's body: on failure print the rank, the message and the place, and end the body with 1.
#define EP_RANK_CHECK(rank, cond, ...)                 \
  do {                                                 \
    if (!(cond)) {                                     \
      fprintf(stderr, "rank %d: ", (rank));            \
      fprintf(stderr, __VA_ARGS__);                    \
      fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__); \
      return 1;                                        \
    }                                                  \
  } while (0)

namespace epcomm::test {

inline std::vector<int> runRanks(int nranks, const std::function<int(int rank)>& body, int timeout_ms = 60000,
                                 const std::function<void(pid_t)>& reaped = {}) {
  std::vector<pid_t> pids(nranks, -1);
  for (int r = 0; r < nranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = body(r);
      } catch (...) {
        rc = 99;
      }
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
    pids[r] = pid;
  }
  const std::vector<pid_t> children = pids;
  std::vector<int> codes(nranks, -1);
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int left = nranks;
  while (left > 0) {
    for (int r = 0; r < nranks; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      pid_t w = waitpid(pids[r], &status, WNOHANG);
      if (w == pids[r]) {
        codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        pids[r] = 0;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > end) {
      for (int r = 0; r < nranks; ++r)
        if (pids[r] > 0) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], nullptr, 0);
          codes[r] = -1;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (reaped)
    for (pid_t c : children) reaped(c);
  return codes;
}

}  // namespace epcomm::test
