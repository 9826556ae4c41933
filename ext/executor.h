// The one native thread that makes every llama.cpp call of an engine.
//
// Python submits jobs into a FIFO queue and returns at once. A job's outcome lands in its
// Ticket; finished asynchronous tickets are also queued on a completion list and announced
// on an eventfd, which asyncio code awaits. Synchronous callers block on the ticket with
// the GIL released. The thread never takes the GIL and never calls Python.
//
// Native objects (models, contexts, sessions) live in a table owned by the thread; Python
// holds only table ids. Dropping a Python handle posts the release to the thread, and
// shutdown frees whatever is left, newest first, on the thread, then joins it.
#pragma once

#include <any>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace engine {

struct Ticket {
    uint64_t id = 0;
    bool notify = false;            // announce completion on the eventfd
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    std::any value;                 // the job's result; converted to Python on a Python thread

    void wait();
    bool is_done();
};

class Executor {
public:
    Executor();
    ~Executor();
    Executor(const Executor &) = delete;
    Executor & operator=(const Executor &) = delete;

    // Submit a job. `notify` tickets are announced on wake_fd() and take_completed().
    std::shared_ptr<Ticket> submit(std::function<std::any()> job, bool notify);

    // Post a fire-and-forget job; silently dropped once the executor is closed.
    void post_quiet(std::function<void()> job);

    // Finish queued jobs, free every object in the table (newest first), join the thread.
    void shutdown();
    bool closed() const;

    int64_t thread_id() const { return thread_id_; }  // kernel tid of the native thread
    int wake_fd() const { return wake_fd_; }
    // Ids of notify tickets finished since the last call; also drains the eventfd.
    std::vector<uint64_t> take_completed();

    // --- object table: native thread only -------------------------------------------
    uint64_t adopt(std::shared_ptr<void> object);
    void erase(uint64_t id);

private:
    void run();

    std::thread thread_;
    int64_t thread_id_ = 0;
    int wake_fd_ = -1;

    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> queue_;
    bool stopping_ = false;
    bool closed_ = false;
    uint64_t next_ticket_ = 1;
    std::vector<uint64_t> completed_;

    std::map<uint64_t, std::shared_ptr<void>> objects_;  // native thread only
    uint64_t next_object_ = 1;
};

}  // namespace engine
