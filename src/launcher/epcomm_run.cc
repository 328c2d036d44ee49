// epcomm-run: starts the R ranks of one program on this machine, mpirun-style.
//
//   epcomm-run -n R [--hosts H] [--timeout-s S] [--tag-output] -- program args...
//
// The launcher creates the communicator's unique id itself (bootstrapGetUniqueId starts the rendezvous
// listener as a thread of this process, so the launcher stays alive while the ranks run) and hands it to every
// rank through EPCOMM_UNIQUE_ID, next to EPCOMM_RANK / EPCOMM_WORLD_SIZE / EPCOMM_LOCAL_RANK /
// EPCOMM_LOCAL_SIZE (and torch's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE). epCommInitFromEnv reads
// them. --hosts H splits the ranks into H contiguous virtual hosts, each with its own EPCOMM_HOSTID, so that
// one machine exercises the inter-host paths.
//
// Supervision:
//  - All ranks share one new process group (led by rank 0), so a signal reaches them and anything they
//    started. SIGINT, SIGTERM and SIGHUP received by the launcher are forwarded to that group.
//  - Fail fast: the first rank that exits non-zero or dies of a signal is reported; the others get SIGTERM,
//    then SIGKILL after EPCOMM_RUN_KILL_GRACE_MS (default 5000).
//  - Exit code: 0 when every rank exited 0; 124 after --timeout-s; 128+SIG when the launcher itself was
//    interrupted by SIG; otherwise the first failing rank's status (128+SIG for a signal); 127 when the program
//    cannot be executed; 2 for usage errors; 1 when the launch itself fails.
//  - Every wait is bounded: the event loop wakes at least every 200 ms, and after SIGKILL the launcher gives
//    up on ranks that still do not die (uninterruptible sleep) after 5 s.
//
// The event loop is single-threaded: signal handlers only write the signal number into a self-pipe, which
// poll() watches together with the ranks' output pipes (--tag-output).
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "common/checks.h"
#include "common/param.h"
#include "common/time.h"
#include "epcomm/epcomm.h"

extern char** environ;

namespace {

using epcomm::nowNs;

EP_PARAM(RunKillGraceMs, "RUN_KILL_GRACE_MS", 5000);

constexpr int kMaxRanks = 1024;
constexpr int kExitLaunchFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitTimeout = 124;
constexpr int kExitCannotExec = 127;
constexpr int64_t kTickNs = 200LL * 1000000;            // the event loop wakes at least this often
constexpr int64_t kReapAfterKillNs = 5000LL * 1000000;  // how long SIGKILLed ranks get to disappear
constexpr int64_t kDrainNs = 1000LL * 1000000;          // output still read after the last rank exited
constexpr size_t kMaxLineBytes = 64 * 1024;             // longer lines are split (--tag-output)
constexpr int kMaxDrainChunks = 64;                     // bound on one drain of an exited rank's pipe
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};

const char kUsage[] =
    "usage: epcomm-run -n R [--hosts H] [--timeout-s S] [--tag-output] [--] program [args...]\n"
    "  -n, --nranks R   number of ranks to start on this machine (1..1024)\n"
    "  --hosts H        split the ranks into H contiguous virtual hosts (R % H == 0); each gets its own\n"
    "                   EPCOMM_HOSTID, and EPCOMM_LOCAL_RANK/SIZE count within the virtual host\n"
    "  --timeout-s S    terminate all ranks after S seconds and exit 124 (0: no limit)\n"
    "  --tag-output     prefix every output line with \"[rank N] \"\n"
    "  -h, --help       show this help\n"
    "Each rank gets EPCOMM_RANK, EPCOMM_WORLD_SIZE, EPCOMM_LOCAL_RANK, EPCOMM_LOCAL_SIZE, EPCOMM_UNIQUE_ID\n"
    "and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. When a rank fails, the others are terminated\n"
    "(SIGTERM, then SIGKILL after EPCOMM_RUN_KILL_GRACE_MS, default 5000).\n";

// ------------------------------------------------------------------------------------------------------------
// Command line
// ------------------------------------------------------------------------------------------------------------

struct Options {
  int nranks = 0;
  int nhosts = 0;  // 0: no --hosts
  double timeout_s = 0;
  bool tag_output = false;
  std::vector<char*> program;  // program and its arguments, not NULL-terminated
};

[[nodiscard]] __attribute__((format(printf, 1, 2))) int usageError(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("epcomm-run: ", stderr);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\n", stderr);
  fwrite(kUsage, 1, strchr(kUsage, '\n') + 1 - kUsage, stderr);  // the synopsis line only
  fputs("(epcomm-run --help tells more)\n", stderr);
  return kExitUsage;
}

bool parseInt(const char* s, long lo, long hi, int* out) {
  if (s == nullptr || *s == '\0') return false;
  errno = 0;
  char* end = nullptr;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = static_cast<int>(v);
  return true;
}

// Returns -1 when the command line is valid, else the exit code (0 for --help).
int parseArgs(int argc, char** argv, Options* opt) {
  bool have_n = false;
  int i = 1;
  // Value of an option given as "--opt V", "--opt=V" or, for -n, "-nV".
  auto value = [&](const char* arg, const char* name, const char** out) -> bool {
    size_t len = strlen(name);
    if (strncmp(arg, name, len) != 0) return false;
    if (arg[len] == '\0') {
      *out = (i + 1 < argc) ? argv[++i] : nullptr;
      return true;
    }
    if (arg[len] == '=' || (name[1] != '-' && len == 2)) {
      *out = arg + len + (arg[len] == '=' ? 1 : 0);
      return true;
    }
    return false;
  };
  for (; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = nullptr;
    if (strcmp(a, "--") == 0) {
      ++i;
      break;
    }
    if (a[0] != '-') break;  // the program starts here
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      fputs(kUsage, stdout);
      return 0;
    }
    if (strcmp(a, "--tag-output") == 0) {
      opt->tag_output = true;
    } else if (value(a, "--nranks", &v) || value(a, "-n", &v)) {
      if (!parseInt(v, 1, kMaxRanks, &opt->nranks))
        return usageError("-n needs a rank count between 1 and 1024, not '%s'", v ? v : "");
      have_n = true;
    } else if (value(a, "--hosts", &v)) {
      if (!parseInt(v, 1, kMaxRanks, &opt->nhosts))
        return usageError("--hosts needs a host count between 1 and 1024, not '%s'", v ? v : "");
    } else if (value(a, "--timeout-s", &v)) {
      char* end = nullptr;
      errno = 0;
      opt->timeout_s = (v && *v) ? strtod(v, &end) : -1;
      if (v == nullptr || *v == '\0' || errno != 0 || *end != '\0' || !std::isfinite(opt->timeout_s) ||
          opt->timeout_s < 0 || opt->timeout_s > 1e9)
        return usageError("--timeout-s needs a number of seconds >= 0, not '%s'", v ? v : "");
    } else {
      return usageError("unknown option '%s'", a);
    }
  }
  if (!have_n) return usageError("missing -n R (the number of ranks)");
  if (i >= argc) return usageError("missing the program to run");
  if (opt->nhosts > 0 && opt->nranks % opt->nhosts != 0)
    return usageError("-n %d is not a multiple of --hosts %d", opt->nranks, opt->nhosts);
  opt->program.assign(argv + i, argv + argc);
  return -1;
}

// ------------------------------------------------------------------------------------------------------------
// Small system helpers
// ------------------------------------------------------------------------------------------------------------

// Writes all of buf; gives up after about a second if fd stays full (a stuck terminal must not hang us) or on
// an error such as EPIPE (output is then dropped).
void writeAll(int fd, const char* buf, size_t len) {
  int stalls = 0;
  while (len > 0) {
    ssize_t n = write(fd, buf, len);
    if (n > 0) {
      buf += n;
      len -= static_cast<size_t>(n);
      stalls = 0;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN && stalls++ < 10) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
    } else {
      return;
    }
  }
}

// Makes sure 0, 1 and 2 are open, so that no pipe we create lands on a standard descriptor.
void ensureStdFds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    int nul = open("/dev/null", O_RDWR);
    if (nul >= 0 && nul != fd) {
      dup2(nul, fd);
      close(nul);
    }
  }
}

// "SIGTERM" for SIGTERM; "signal 42" when the signal has no name.
std::string signalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string describeStatus(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + signalName(WTERMSIG(status));
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// Exit code of a rank as a shell reports it: the status, or 128 + signal.
int exitCodeOf(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

// The path execve should run for `name`, searching PATH like execvp. Returns false with *err set when no
// candidate is executable; *path then holds the best guess (the file that exists, if any).
bool resolveProgram(const char* name, std::string* path, int* err) {
  auto executable = [](const std::string& p, int* e) {
    struct stat st;
    if (stat(p.c_str(), &st) != 0) {
      *e = errno;
      return false;
    }
    if (S_ISDIR(st.st_mode) || access(p.c_str(), X_OK) != 0) {
      *e = EACCES;
      return false;
    }
    return true;
  };
  *err = ENOENT;
  if (strchr(name, '/') != nullptr) {
    *path = name;
    return executable(*path, err);
  }
  const char* env = getenv("PATH");
  std::string dirs = env ? env : "/usr/local/bin:/usr/bin:/bin";
  *path = name;
  bool found_file = false;
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    std::string cand = (dir.empty() ? std::string(".") : dir) + "/" + name;
    int e = ENOENT;
    if (executable(cand, &e)) {
      *path = cand;
      return true;
    }
    if (e == EACCES && !found_file) {  // remember it for the error message, keep searching
      found_file = true;
      *path = cand;
      *err = EACCES;
    }
    start = end + 1;
  }
  return false;
}

// "<hostname>.<pid>.<random>": unique among the launchers that run at the same time.
std::string hostIdPrefix() {
  char host[HOST_NAME_MAX + 1] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') snprintf(host, sizeof(host), "localhost");
  std::random_device rd;
  char buf[HOST_NAME_MAX + 64];
  snprintf(buf, sizeof(buf), "%s.%d.%08x", host, static_cast<int>(getpid()), static_cast<unsigned>(rd()));
  return buf;
}

// ------------------------------------------------------------------------------------------------------------
// Signals: handlers only note the signal in a self-pipe that the event loop polls.
// ------------------------------------------------------------------------------------------------------------

int gSignalPipe[2] = {-1, -1};

void onSignal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t ignored = write(gSignalPipe[1], &b, 1);  // non-blocking: a full pipe already holds a wake-up
  (void)ignored;
  errno = saved;
}

// The dispositions the launcher found at startup; children get them back before exec.
struct SavedSignals {
  struct sigaction chld, pipe, fwd[3];
  bool fwd_ignored[3] = {false, false, false};
};

bool installSignalHandlers(SavedSignals* saved) {
  if (pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  if (sigaction(SIGCHLD, &sa, &saved->chld) != 0) return false;
  sa.sa_flags = SA_RESTART;
  for (int k = 0; k < 3; ++k) {
    if (sigaction(kForwardedSignals[k], nullptr, &saved->fwd[k]) != 0) return false;
    // A signal ignored at startup (nohup, background jobs) stays ignored, as shells do.
    saved->fwd_ignored[k] = saved->fwd[k].sa_handler == SIG_IGN;
    if (!saved->fwd_ignored[k] && sigaction(kForwardedSignals[k], &sa, nullptr) != 0) return false;
  }
  // Writing tagged output to a closed reader must not kill the launcher (and with it the supervision).
  struct sigaction ign;
  memset(&ign, 0, sizeof(ign));
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  return sigaction(SIGPIPE, &ign, &saved->pipe) == 0;
}

// ------------------------------------------------------------------------------------------------------------
// Ranks
// ------------------------------------------------------------------------------------------------------------

// One output stream of a rank under --tag-output: the read end of its pipe and the unfinished last line.
struct TaggedStream {
  int fd = -1;    // read end, non-blocking; -1 once closed
  int dest = -1;  // 1 or 2
  std::string partial;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  // Prepared before fork (the child may only make async-signal-safe calls).
  std::vector<std::string> env;
  std::vector<char*> envp;
  std::string exec_error_prefix;  // "epcomm-run: rank N: cannot execute 'prog': "
  std::string tag;                // "[rank N] "
  TaggedStream out[2];            // stdout, stderr
  int child_fd[2] = {-1, -1};     // write ends, given to the child as 1 and 2
};

// The variables epcomm-run sets; inherited values of them are replaced.
const char* const kSetVars[] = {"EPCOMM_RANK",  "EPCOMM_WORLD_SIZE", "EPCOMM_LOCAL_RANK", "EPCOMM_LOCAL_SIZE",
                                "EPCOMM_UNIQUE_ID", "EPCOMM_HOSTID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "LOCAL_WORLD_SIZE"};

bool isSetVar(const char* entry, bool hosts) {
  for (const char* name : kSetVars) {
    if (!hosts && strcmp(name, "EPCOMM_HOSTID") == 0) continue;  // the user's own value is inherited
    size_t len = strlen(name);
    if (strncmp(entry, name, len) == 0 && entry[len] == '=') return true;
  }
  return false;
}

void buildEnv(Rank* r, const Options& opt, const std::string& id_str, const std::string& host_prefix) {
  const bool hosts = opt.nhosts > 0;
  const int local_size = hosts ? opt.nranks / opt.nhosts : opt.nranks;
  const int local_rank = r->rank % local_size;
  for (char** e = environ; *e != nullptr; ++e)
    if (!isSetVar(*e, hosts)) r->env.emplace_back(*e);
  auto set = [&](const char* name, const std::string& v) { r->env.push_back(std::string(name) + "=" + v); };
  set("EPCOMM_RANK", std::to_string(r->rank));
  set("EPCOMM_WORLD_SIZE", std::to_string(opt.nranks));
  set("EPCOMM_LOCAL_RANK", std::to_string(local_rank));
  set("EPCOMM_LOCAL_SIZE", std::to_string(local_size));
  set("EPCOMM_UNIQUE_ID", id_str);
  if (hosts) set("EPCOMM_HOSTID", host_prefix + "-h" + std::to_string(r->rank / local_size));
  set("RANK", std::to_string(r->rank));
  set("WORLD_SIZE", std::to_string(opt.nranks));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("LOCAL_WORLD_SIZE", std::to_string(local_size));
  for (auto& s : r->env) r->envp.push_back(s.data());
  r->envp.push_back(nullptr);
}

// Everything the child needs between fork and exec, prepared up front.
struct ExecPlan {
  std::string path;                 // resolved program
  std::vector<char*> argv;          // program args..., NULL
  std::vector<char*> sh_argv;       // /bin/sh path args..., NULL (for scripts without #!, like execvp)
  const SavedSignals* signals = nullptr;
  sigset_t child_mask;              // signal mask to restore in the child
  rlimit nofile;                    // the descriptor limit the launcher started with
  pid_t launcher = 0;
};

void childWrite(const char* s) { writeAll(2, s, strlen(s)); }

// Runs in the child after fork: async-signal-safe calls only. Never returns.
[[noreturn]] void execChild(const Rank& r, pid_t pgid, const ExecPlan& plan) {
  setpgid(0, pgid);  // the parent does the same; whichever comes first wins
  // Die with the launcher, even if it is SIGKILLed (prctl applies to the forking thread: the main thread).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != plan.launcher) _exit(kExitLaunchFailed);
  if (r.child_fd[0] >= 0) {
    dup2(r.child_fd[0], 1);  // the pipes are O_CLOEXEC; the duplicates are not
    dup2(r.child_fd[1], 2);
  }
  sigaction(SIGCHLD, &plan.signals->chld, nullptr);
  sigaction(SIGPIPE, &plan.signals->pipe, nullptr);
  for (int k = 0; k < 3; ++k) sigaction(kForwardedSignals[k], &plan.signals->fwd[k], nullptr);
  setrlimit(RLIMIT_NOFILE, &plan.nofile);
  sigprocmask(SIG_SETMASK, &plan.child_mask, nullptr);
  execve(plan.path.c_str(), plan.argv.data(), r.envp.data());
  if (errno == ENOEXEC) execve("/bin/sh", plan.sh_argv.data(), r.envp.data());
  int err = errno;
  childWrite(r.exec_error_prefix.c_str());
  const char* desc = strerrordesc_np(err);
  childWrite(desc ? desc : "unknown error");
  childWrite("\n");
  _exit(kExitCannotExec);
}

// ------------------------------------------------------------------------------------------------------------
// The supervisor
// ------------------------------------------------------------------------------------------------------------

class Launcher {
 public:
  explicit Launcher(const Options& opt) : opt_(opt) {}

  // Starts the ranks and supervises them until all have exited; returns the launcher's exit code.
  int run(const std::string& id_str, const ExecPlan& plan);

 private:
  enum class Phase { kRunning, kTerminating, kKilling };

  bool spawn(const ExecPlan& plan);
  void handleSignals();
  void reap();
  void onRankExit(Rank& r, int status);
  void readOutput(TaggedStream& s, const Rank& r, bool drain);
  void flushPartial(TaggedStream& s, const Rank& r);
  void closeStream(TaggedStream& s, const Rank& r);
  void signalAll(int sig);
  void beginTermination();
  void checkDeadlines();
  int exitCode() const;

  const Options& opt_;
  std::vector<Rank> ranks_;
  pid_t pgid_ = 0;
  int running_ = 0;
  int open_streams_ = 0;
  Phase phase_ = Phase::kRunning;
  // Outcome
  bool launch_failed_ = false;
  bool timed_out_ = false;
  int interrupt_signal_ = 0;  // first signal received by the launcher
  int first_failure_ = 0;     // exit code of the first failing rank, 0 if none
  // Deadlines (nowNs() scale; INT64_MAX = none)
  int64_t run_deadline_ = INT64_MAX;
  int64_t kill_deadline_ = INT64_MAX;
  int64_t reap_deadline_ = INT64_MAX;
  int64_t drain_deadline_ = INT64_MAX;
};

bool Launcher::spawn(const ExecPlan& plan) {
  // Block every signal around fork: a signal that reaches the child before it restored the default
  // dispositions would otherwise run our handler there and write into the shared self-pipe.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  bool ok = true;
  for (Rank& r : ranks_) {
    pid_t pid = fork();
    if (pid < 0) {
      fprintf(stderr, "epcomm-run: cannot start rank %d: fork: %s\n", r.rank, strerror(errno));
      ok = false;
      break;
    }
    if (pid == 0) execChild(r, pgid_, plan);
    if (pgid_ == 0) pgid_ = pid;  // rank 0 leads the group
    setpgid(pid, pgid_);          // may fail harmlessly if the child already did it and exec'd
    r.pid = pid;
    r.running = true;
    ++running_;
    for (int k = 0; k < 2; ++k)
      if (r.child_fd[k] >= 0) {
        close(r.child_fd[k]);
        r.child_fd[k] = -1;
      }
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return ok;
}

// Sends sig to every rank that still runs and to whatever they started in the group.
void Launcher::signalAll(int sig) {
  if (running_ == 0) return;
  if (pgid_ > 0) kill(-pgid_, sig);
  for (const Rank& r : ranks_)  // a rank that is not in the group (setpgid failed) is signalled alone
    if (r.running && getpgid(r.pid) != pgid_) kill(r.pid, sig);
}

void Launcher::beginTermination() {
  if (phase_ != Phase::kRunning) return;
  phase_ = Phase::kTerminating;
  const int64_t grace_ms = std::max<int64_t>(0, epParamRunKillGraceMs());
  kill_deadline_ = nowNs() + grace_ms * 1000000;
  if (running_ > 0) {
    fprintf(stderr, "epcomm-run: terminating %d remaining rank%s\n", running_, running_ == 1 ? "" : "s");
    signalAll(SIGTERM);
  }
}

void Launcher::handleSignals() {
  unsigned char buf[64];
  bool child = false;
  for (;;) {
    ssize_t n = read(gSignalPipe[0], buf, sizeof(buf));
    if (n <= 0) break;
    for (ssize_t k = 0; k < n; ++k) {
      int sig = buf[k];
      if (sig == SIGCHLD) {
        child = true;
        continue;
      }
      // SIGINT / SIGTERM / SIGHUP: forward, then give the ranks the grace period like any termination.
      if (interrupt_signal_ == 0) {
        interrupt_signal_ = sig;
        fprintf(stderr, "epcomm-run: received %s; forwarding it to %d rank%s\n", signalName(sig).c_str(),
                running_, running_ == 1 ? "" : "s");
      }
      signalAll(sig);
      if (phase_ == Phase::kRunning) {
        phase_ = Phase::kTerminating;
        kill_deadline_ = nowNs() + std::max<int64_t>(0, epParamRunKillGraceMs()) * 1000000;
      }
    }
  }
  if (child) reap();
}

void Launcher::reap() {
  for (Rank& r : ranks_) {
    if (!r.running) continue;
    int status = 0;
    pid_t w;
    do {
      w = waitpid(r.pid, &status, WNOHANG);
    } while (w < 0 && errno == EINTR);
    if (w == r.pid) {
      onRankExit(r, status);
    } else if (w < 0) {  // not our child any more (cannot happen): stop waiting for it
      r.running = false;
      --running_;
    }
  }
}

void Launcher::onRankExit(Rank& r, int status) {
  r.running = false;
  r.status = status;
  --running_;
  // Its output is complete now (unless it left children behind): show it before the verdict.
  for (TaggedStream& s : r.out)
    if (s.fd >= 0) readOutput(s, r, /*drain=*/true);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  if (first_failure_ == 0) first_failure_ = exitCodeOf(status);
  if (phase_ == Phase::kRunning) {  // a failure of its own, not one we caused: report it and fail fast
    fprintf(stderr, "epcomm-run: rank %d %s\n", r.rank, describeStatus(status).c_str());
    beginTermination();
  }
}

void Launcher::closeStream(TaggedStream& s, const Rank& r) {
  flushPartial(s, r);
  close(s.fd);
  s.fd = -1;
  --open_streams_;
}

void Launcher::flushPartial(TaggedStream& s, const Rank& r) {
  if (s.partial.empty()) return;
  std::string line = r.tag + s.partial + "\n";
  writeAll(s.dest, line.data(), line.size());
  s.partial.clear();
}

// Reads what the pipe holds and writes every complete line with the rank's tag. With drain, reads until the
// pipe is empty (at most kMaxDrainChunks chunks, in case something the rank started keeps writing); otherwise
// one chunk, so that one chatty rank cannot starve the loop.
void Launcher::readOutput(TaggedStream& s, const Rank& r, bool drain) {
  char buf[16384];
  int chunks = 0;
  do {
    ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {  // EOF or error
      closeStream(s, r);
      return;
    }
    std::string out;
    size_t begin = 0;
    for (ssize_t k = 0; k < n; ++k) {
      if (buf[k] != '\n') continue;
      out += r.tag;
      out += s.partial;
      out.append(buf + begin, static_cast<size_t>(k) + 1 - begin);
      s.partial.clear();
      begin = static_cast<size_t>(k) + 1;
    }
    s.partial.append(buf + begin, static_cast<size_t>(n) - begin);
    writeAll(s.dest, out.data(), out.size());
    if (s.partial.size() >= kMaxLineBytes) flushPartial(s, r);
  } while (drain && ++chunks < kMaxDrainChunks);
}

void Launcher::checkDeadlines() {
  const int64_t now = nowNs();
  if (phase_ == Phase::kRunning && now >= run_deadline_) {
    timed_out_ = true;
    fprintf(stderr, "epcomm-run: timeout: the ranks ran longer than --timeout-s %g\n", opt_.timeout_s);
    beginTermination();
  }
  if (phase_ == Phase::kTerminating && now >= kill_deadline_) {
    phase_ = Phase::kKilling;
    reap_deadline_ = now + kReapAfterKillNs;
    if (running_ > 0) {
      fprintf(stderr, "epcomm-run: %d rank%s still running after %lld ms; sending SIGKILL\n", running_,
              running_ == 1 ? "" : "s", static_cast<long long>(epParamRunKillGraceMs()));
      signalAll(SIGKILL);
    }
  }
}

int Launcher::exitCode() const {
  if (timed_out_) return kExitTimeout;
  if (interrupt_signal_ != 0) return 128 + interrupt_signal_;
  if (launch_failed_) return kExitLaunchFailed;
  return first_failure_;
}

int Launcher::run(const std::string& id_str, const ExecPlan& plan) {
  const std::string host_prefix = opt_.nhosts > 0 ? hostIdPrefix() : std::string();
  ranks_.resize(static_cast<size_t>(opt_.nranks));
  for (int i = 0; i < opt_.nranks; ++i) {
    Rank& r = ranks_[static_cast<size_t>(i)];
    r.rank = i;
    r.tag = "[rank " + std::to_string(i) + "] ";
    r.exec_error_prefix = "epcomm-run: rank " + std::to_string(i) + ": cannot execute '" + plan.path + "': ";
    buildEnv(&r, opt_, id_str, host_prefix);
    if (!opt_.tag_output) continue;
    for (int k = 0; k < 2; ++k) {
      int fds[2];
      if (pipe2(fds, O_CLOEXEC) != 0) {
        fprintf(stderr, "epcomm-run: cannot create output pipes: %s\n", strerror(errno));
        return kExitLaunchFailed;  // nothing started yet; the descriptors close at exit
      }
      fcntl(fds[0], F_SETFL, O_NONBLOCK);
      r.out[k].fd = fds[0];
      r.out[k].dest = k + 1;
      r.child_fd[k] = fds[1];
      ++open_streams_;
    }
  }

  if (opt_.timeout_s > 0) run_deadline_ = nowNs() + static_cast<int64_t>(opt_.timeout_s * 1e9);
  if (!spawn(plan)) {
    launch_failed_ = true;
    beginTermination();
  }

  // The event loop: runs while ranks live, then drains their output for at most kDrainNs.
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, TaggedStream*>> owners;
  while (running_ > 0 || (open_streams_ > 0 && nowNs() < drain_deadline_)) {
    const int64_t now = nowNs();
    int64_t next = std::min({now + kTickNs, run_deadline_, drain_deadline_,
                             phase_ == Phase::kTerminating ? kill_deadline_ : INT64_MAX});
    int timeout_ms = static_cast<int>(std::clamp<int64_t>((next - now + 999999) / 1000000, 0, kTickNs / 1000000));

    fds.clear();
    owners.clear();
    fds.push_back({gSignalPipe[0], POLLIN, 0});
    for (Rank& r : ranks_)
      for (TaggedStream& s : r.out)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.emplace_back(&r, &s);
        }
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      fprintf(stderr, "epcomm-run: poll: %s\n", strerror(errno));
      break;
    }
    if (n > 0) {
      for (size_t k = 1; k < fds.size(); ++k)
        if (fds[k].revents != 0 && owners[k - 1].second->fd >= 0)
          readOutput(*owners[k - 1].second, *owners[k - 1].first, /*drain=*/false);
      if (fds[0].revents != 0) handleSignals();
    }
    reap();  // cheap, and covers a SIGCHLD that raced with the previous reap
    checkDeadlines();
    if (running_ == 0 && drain_deadline_ == INT64_MAX) drain_deadline_ = nowNs() + kDrainNs;
    if (phase_ == Phase::kKilling && running_ > 0 && nowNs() >= reap_deadline_) {
      fprintf(stderr, "epcomm-run: %d rank%s did not exit after SIGKILL; giving up on %s\n", running_,
              running_ == 1 ? "" : "s", running_ == 1 ? "it" : "them");
      if (first_failure_ == 0) first_failure_ = 128 + SIGKILL;
      break;
    }
  }

  // Whatever is left (output held open by processes the ranks started): close it, keeping partial lines.
  for (Rank& r : ranks_)
    for (TaggedStream& s : r.out)
      if (s.fd >= 0) closeStream(s, r);
  const int code = exitCode();
  // After a failure, nothing the ranks started may outlive the job.
  if (code != 0 && pgid_ > 0) kill(-pgid_, SIGKILL);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  int rc = parseArgs(argc, argv, &opt);
  if (rc >= 0) return rc;
  ensureStdFds();

  // The program: resolved once here, so that a typo gives one message rather than one per rank.
  ExecPlan plan;
  int err = 0;
  if (!resolveProgram(opt.program[0], &plan.path, &err)) {
    fprintf(stderr, "epcomm-run: cannot execute '%s': %s\n", opt.program[0], strerror(err));
    return kExitCannotExec;
  }
  plan.argv = opt.program;
  plan.argv.push_back(nullptr);
  plan.sh_argv.push_back(const_cast<char*>("/bin/sh"));
  plan.sh_argv.push_back(plan.path.data());
  plan.sh_argv.insert(plan.sh_argv.end(), opt.program.begin() + 1, opt.program.end());
  plan.sh_argv.push_back(nullptr);
  plan.launcher = getpid();

  // --tag-output holds two pipes per rank: raise the soft descriptor limit if needed (children get the
  // original limit back).
  getrlimit(RLIMIT_NOFILE, &plan.nofile);
  if (opt.tag_output) {
    const rlim_t need = 2 * static_cast<rlim_t>(opt.nranks) + 64;
    if (plan.nofile.rlim_cur != RLIM_INFINITY && plan.nofile.rlim_cur < need) {
      rlimit raised = plan.nofile;
      raised.rlim_cur = (plan.nofile.rlim_max == RLIM_INFINITY) ? need : std::min(need, plan.nofile.rlim_max);
      if (raised.rlim_cur < need || setrlimit(RLIMIT_NOFILE, &raised) != 0) {
        fprintf(stderr, "epcomm-run: --tag-output with -n %d needs %llu file descriptors; the limit is %llu\n",
                opt.nranks, static_cast<unsigned long long>(need),
                static_cast<unsigned long long>(plan.nofile.rlim_max));
        return kExitLaunchFailed;
      }
    }
  }

  SavedSignals signals;
  if (!installSignalHandlers(&signals)) {
    fprintf(stderr, "epcomm-run: cannot install signal handlers: %s\n", strerror(errno));
    return kExitLaunchFailed;
  }
  plan.signals = &signals;
  pthread_sigmask(SIG_SETMASK, nullptr, &plan.child_mask);

  // The unique id: its rendezvous listener is a thread of this process and serves the ranks while they start.
  epUniqueId id;
  char id_str[EP_UNIQUE_ID_STRING_BYTES];
  if (epcomm::bootstrapGetUniqueId(&id) != epSuccess ||
      epcomm::uniqueIdToString(&id, id_str, sizeof(id_str)) != epSuccess) {
    fprintf(stderr, "epcomm-run: cannot create the communicator's unique id: %s\n",
            epcomm::threadLastError());
    return kExitLaunchFailed;
  }

  Launcher launcher(opt);
  return launcher.run(id_str, plan);
}
