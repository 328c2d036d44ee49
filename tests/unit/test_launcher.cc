// Tests of epcomm-run, the launcher: environment per rank, virtual hosts, fail-fast, signal forwarding,
// timeouts, output tagging and usage errors. The ranks are small /bin/sh programs; each test takes a few
// seconds at most, and every wait here has a deadline.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef EPCOMM_BUILD_DIR
#error "EPCOMM_BUILD_DIR must name the build root"
#endif

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char kLauncher[] = EPCOMM_BUILD_DIR "/src/launcher/epcomm-run";

struct RunResult {
  int code = -1;        // exit status, 128 + signal, or -1 when the launcher outlived the test's deadline
  double seconds = 0;   // from start to exit
  std::string out, err; // the launcher's stdout and stderr
};

std::string readFile(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// "KEY=VALUE" lines (the output of `env`) as a map.
std::map<std::string, std::string> parseEnv(const std::string& text) {
  std::map<std::string, std::string> m;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    size_t eq = line.find('=');
    if (eq != std::string::npos) m[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return m;
}

// Waits until `pred` holds or timeout_ms passes; returns pred's last value.
bool waitFor(const std::function<bool()>& pred, int timeout_ms) {
  auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!pred()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kLauncher, X_OK) != 0) GTEST_SKIP() << kLauncher << " is not built";
    std::string tmpl = (fs::temp_directory_path() / "epcomm-launcher-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  // Runs epcomm-run with args. extra_env entries ("K=V") are added to a copy of this process's environment
  // without the variables the launcher sets. while_running(pid) runs in this process while the launcher runs.
  RunResult run(const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {},
                const std::function<void(pid_t)>& while_running = nullptr, int timeout_ms = 20000) {
    static const char* const kDropped[] = {"EPCOMM_HOSTID=", "EPCOMM_RUN_KILL_GRACE_MS=", "EPCOMM_RANK=",
                                           "EPCOMM_WORLD_SIZE=", "EPCOMM_UNIQUE_ID=", "EPCOMM_LOCAL_RANK=",
                                           "EPCOMM_LOCAL_SIZE="};
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      bool drop = false;
      for (const char* d : kDropped) drop = drop || strncmp(*e, d, strlen(d)) == 0;
      if (!drop) env.emplace_back(*e);
    }
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> envp, argv;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> all_args = args;
    all_args.insert(all_args.begin(), kLauncher);
    for (auto& s : all_args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const std::string out_path = (dir_ / "launcher.out").string();
    const std::string err_path = (dir_ / "launcher.err").string();

    RunResult res;
    auto start = Clock::now();
    pid_t pid = fork();
    if (pid == 0) {
      // The launcher must see the default dispositions whatever the test runner set up.
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      if (!freopen(out_path.c_str(), "w", stdout) || !freopen(err_path.c_str(), "w", stderr)) _exit(99);
      execve(kLauncher, argv.data(), envp.data());
      _exit(98);
    }
    EXPECT_GT(pid, 0);
    if (pid <= 0) return res;
    if (while_running) while_running(pid);
    int status = 0;
    bool done = waitFor([&] { return waitpid(pid, &status, WNOHANG) == pid; }, timeout_ms);
    if (!done) {
      kill(pid, SIGKILL);  // its ranks die with it (parent-death signal)
      waitpid(pid, &status, 0);
      res.code = -1;
    } else {
      res.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    res.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    res.out = readFile(out_path);
    res.err = readFile(err_path);
    return res;
  }

  // Each rank writes its environment to <dir>/env.<rank>; returns them, rank by rank.
  std::vector<std::map<std::string, std::string>> runAndCollectEnv(const std::vector<std::string>& opts, int n,
                                                                   const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = opts;
    args.insert(args.end(), {"--", "/bin/sh", "-c", "env > \"$0/env.$EPCOMM_RANK\"", dir_.string()});
    RunResult r = run(args, extra);
    EXPECT_EQ(r.code, 0) << r.err;
    std::vector<std::map<std::string, std::string>> envs;
    for (int i = 0; i < n; ++i) {
      fs::path p = dir_ / ("env." + std::to_string(i));
      EXPECT_TRUE(fs::exists(p)) << "rank " << i << " wrote no environment";
      envs.push_back(parseEnv(readFile(p)));
    }
    return envs;
  }

  // Number of files named <prefix>* in the test directory.
  int countFiles(const std::string& prefix) const {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
    return n;
  }

  fs::path dir_;
};

bool isHex(const std::string& s) {
  return s.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
}

TEST_F(LauncherTest, SetsEnvironmentPerRank) {
  const int n = 4;
  auto envs = runAndCollectEnv({"-n", std::to_string(n)}, n, {"EPCOMM_TEST_MARKER=passes through"});
  ASSERT_EQ(envs.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    auto& e = envs[static_cast<size_t>(i)];
    SCOPED_TRACE("rank " + std::to_string(i));
    EXPECT_EQ(e["EPCOMM_RANK"], std::to_string(i));
    EXPECT_EQ(e["EPCOMM_WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(e["EPCOMM_LOCAL_RANK"], std::to_string(i));
    EXPECT_EQ(e["EPCOMM_LOCAL_SIZE"], std::to_string(n));
    EXPECT_EQ(e["RANK"], std::to_string(i));
    EXPECT_EQ(e["WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(i));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(e["EPCOMM_TEST_MARKER"], "passes through");
    EXPECT_EQ(e.count("EPCOMM_HOSTID"), 0u) << "a single host must not get an EPCOMM_HOSTID";
    // One id for the whole job, as 2 * EP_UNIQUE_ID_BYTES hex digits.
    EXPECT_EQ(e["EPCOMM_UNIQUE_ID"].size(), 256u);
    EXPECT_TRUE(isHex(e["EPCOMM_UNIQUE_ID"])) << e["EPCOMM_UNIQUE_ID"];
    EXPECT_EQ(e["EPCOMM_UNIQUE_ID"], envs[0]["EPCOMM_UNIQUE_ID"]);
  }
}

TEST_F(LauncherTest, InheritsUserHostIdWithoutHosts) {
  auto envs = runAndCollectEnv({"-n", "2"}, 2, {"EPCOMM_HOSTID=my-host"});
  for (auto& e : envs) EXPECT_EQ(e["EPCOMM_HOSTID"], "my-host");
}

TEST_F(LauncherTest, HostsSplitRanksIntoContiguousVirtualHosts) {
  const int n = 6, hosts = 3, per_host = n / hosts;
  auto envs = runAndCollectEnv({"-n", std::to_string(n), "--hosts", std::to_string(hosts)}, n,
                               {"EPCOMM_HOSTID=overridden"});
  ASSERT_EQ(envs.size(), static_cast<size_t>(n));
  std::set<std::string> ids;
  for (int i = 0; i < n; ++i) {
    auto& e = envs[static_cast<size_t>(i)];
    SCOPED_TRACE("rank " + std::to_string(i));
    EXPECT_EQ(e["EPCOMM_RANK"], std::to_string(i));
    EXPECT_EQ(e["EPCOMM_WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(e["EPCOMM_LOCAL_RANK"], std::to_string(i % per_host));
    EXPECT_EQ(e["EPCOMM_LOCAL_SIZE"], std::to_string(per_host));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(i % per_host));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], std::to_string(per_host));
    ASSERT_EQ(e.count("EPCOMM_HOSTID"), 1u);
    EXPECT_NE(e["EPCOMM_HOSTID"], "overridden");
    // Equal within a virtual host, different across them.
    EXPECT_EQ(e["EPCOMM_HOSTID"], envs[static_cast<size_t>(i - i % per_host)]["EPCOMM_HOSTID"]);
    ids.insert(e["EPCOMM_HOSTID"]);
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(hosts));
}

TEST_F(LauncherTest, HostIdsDifferAcrossLaunchers) {
  auto a = runAndCollectEnv({"-n", "2", "--hosts", "2"}, 2);
  auto b = runAndCollectEnv({"-n", "2", "--hosts", "2"}, 2);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_NE(a[0]["EPCOMM_HOSTID"], b[0]["EPCOMM_HOSTID"]);
  EXPECT_NE(a[0]["EPCOMM_UNIQUE_ID"], b[0]["EPCOMM_UNIQUE_ID"]);
}

TEST_F(LauncherTest, PassesArgumentsUnchanged) {
  RunResult r = run({"-n", "1", "--", "/bin/sh", "-c", "printf '%s|' \"$@\" > \"$0/args\"", dir_.string(), "a b",
                     "", "-n", "--"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(readFile(dir_ / "args"), "a b||-n|--|");
}

TEST_F(LauncherTest, AllRanksSucceed) {
  RunResult r = run({"-n", "16", "--", "/bin/sh", "-c", "[ $EPCOMM_RANK -lt 8 ] || sleep 0.2"});
  EXPECT_EQ(r.code, 0) << r.err;
  RunResult t = run({"-n", "3", "true"});  // without "--", found through PATH
  EXPECT_EQ(t.code, 0) << t.err;
}

TEST_F(LauncherTest, FailsFastWhenARankExitsNonZero) {
  RunResult r = run({"-n", "4", "--", "/bin/sh", "-c", "if [ $EPCOMM_RANK = 1 ]; then exit 3; fi; sleep 30"});
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.err.find("rank 1 exited with status 3"), std::string::npos) << r.err;
}

TEST_F(LauncherTest, ReportsTheFirstFailure) {
  // Rank 2 fails first with 5; rank 0 fails later with 7 (it exits on its own, not because of SIGTERM).
  RunResult r = run({"-n", "3", "--", "/bin/sh", "-c",
                     "trap 'exit 7' TERM; case $EPCOMM_RANK in 2) exit 5;; *) sleep 30 & wait;; esac"});
  EXPECT_EQ(r.code, 5) << r.err;
  EXPECT_LT(r.seconds, 5.0);
}

TEST_F(LauncherTest, RankKilledBySignalGives128PlusSignal) {
  RunResult r = run({"-n", "4", "--", "/bin/sh", "-c", "if [ $EPCOMM_RANK = 2 ]; then kill -9 $$; fi; sleep 30"});
  EXPECT_EQ(r.code, 128 + SIGKILL) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.err.find("rank 2 killed by signal SIGKILL"), std::string::npos) << r.err;
}

// Ranks write their pid to <dir>/started.<rank>, then sleep; returns once all n have started.
const char kStartThenSleep[] = "echo $$ > \"$0/started.$EPCOMM_RANK\"; exec sleep 30";

std::vector<pid_t> rankPids(const fs::path& dir, int n) {
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) pids.push_back(atoi(readFile(dir / ("started." + std::to_string(i))).c_str()));
  return pids;
}

TEST_F(LauncherTest, ForwardsSigtermToAllRanks) {
  const int n = 3;
  bool started = false;
  RunResult r = run({"-n", std::to_string(n), "--", "/bin/sh", "-c", kStartThenSleep, dir_.string()}, {},
                    [&](pid_t launcher) {
                      started = waitFor([&] { return countFiles("started.") == n; }, 5000);
                      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // files complete
                      kill(launcher, SIGTERM);
                    });
  ASSERT_TRUE(started);
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  for (pid_t p : rankPids(dir_, n)) {
    ASSERT_GT(p, 0);
    EXPECT_TRUE(kill(p, 0) != 0 && errno == ESRCH) << "rank pid " << p << " still exists";
  }
}

TEST_F(LauncherTest, ForwardsSigintAndLetsRanksExitCleanly) {
  const int n = 2;
  // Each rank handles SIGINT itself (writes a file, exits 0): the launcher still reports the interruption.
  const std::string prog =
      "trap 'echo > \"$0/interrupted.$EPCOMM_RANK\"; exit 0' INT; echo > \"$0/started.$EPCOMM_RANK\"; "
      "while :; do sleep 0.05; done";
  RunResult r = run({"-n", std::to_string(n), "--", "/bin/sh", "-c", prog, dir_.string()}, {},
                    [&](pid_t launcher) {
                      waitFor([&] { return countFiles("started.") == n; }, 5000);
                      kill(launcher, SIGINT);
                    });
  EXPECT_EQ(r.code, 128 + SIGINT) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_EQ(countFiles("interrupted."), n);
}

TEST_F(LauncherTest, TimeoutKillsEverythingAndExits124) {
  RunResult r = run({"-n", "2", "--timeout-s", "1", "--", "/bin/sh", "-c", "sleep 30"});
  EXPECT_EQ(r.code, 124) << r.err;
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_NE(r.err.find("timeout"), std::string::npos) << r.err;
}

TEST_F(LauncherTest, RanksIgnoringSigtermGetSigkillAfterTheGrace) {
  RunResult r = run({"-n", "2", "--timeout-s", "0.5", "--", "/bin/sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"},
                    {"EPCOMM_RUN_KILL_GRACE_MS=300"});
  EXPECT_EQ(r.code, 124) << r.err;
  EXPECT_LT(r.seconds, 4.0);
  EXPECT_NE(r.err.find("SIGKILL"), std::string::npos) << r.err;
}

TEST_F(LauncherTest, TagOutputPrefixesEveryLine) {
  RunResult r = run({"-n", "2", "--tag-output", "--", "/bin/sh", "-c",
                     "echo hello; echo oops >&2; printf 'no newline'"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (int i = 0; i < 2; ++i) {
    std::string tag = "[rank " + std::to_string(i) + "] ";
    EXPECT_NE(r.out.find(tag + "hello\n"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(tag + "no newline\n"), std::string::npos) << r.out;
    EXPECT_NE(r.err.find(tag + "oops\n"), std::string::npos) << r.err;
  }
  // Every line carries a tag.
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
}

TEST_F(LauncherTest, WithoutTagOutputRanksWriteDirectly) {
  RunResult r = run({"-n", "2", "--", "/bin/sh", "-c", "echo plain"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "plain\nplain\n");
}

TEST_F(LauncherTest, UsageErrorsExit2) {
  const std::vector<std::vector<std::string>> cases = {
      {},                                    // nothing
      {"true"},                              // no -n
      {"-n", "0", "true"},                   // R < 1
      {"-n", "1025", "true"},                // R > 1024
      {"-n", "abc", "true"},                 // not a number
      {"-n", "2"},                           // no program
      {"-n", "2", "--"},                     // no program after --
      {"-n", "6", "--hosts", "4", "true"},   // R % H != 0
      {"-n", "2", "--hosts", "0", "true"},   // H < 1
      {"-n", "2", "--timeout-s", "x", "true"},
      {"-n", "2", "--no-such-option", "true"},
  };
  for (const auto& args : cases) {
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    RunResult r = run(args);
    EXPECT_EQ(r.code, 2) << "epcomm-run " << joined << "\n" << r.err;
    EXPECT_NE(r.err.find("usage"), std::string::npos) << joined;
  }
}

TEST_F(LauncherTest, ProgramThatCannotBeExecutedExits127) {
  RunResult r = run({"-n", "2", "--", "/nonexistent/program"});
  EXPECT_EQ(r.code, 127);
  EXPECT_NE(r.err.find("/nonexistent/program"), std::string::npos) << r.err;
  RunResult p = run({"-n", "2", "--", "no-such-program-in-path-epcomm"});
  EXPECT_EQ(p.code, 127);
  // A rank whose own exec fails (here inside the shell) also gives 127.
  RunResult s = run({"-n", "2", "--", "/bin/sh", "-c", "exec /nonexistent/program"});
  EXPECT_EQ(s.code, 127);
}

}  // namespace
