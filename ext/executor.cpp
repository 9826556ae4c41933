#include "executor.h"

#include "errors.h"

#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace engine {

void Ticket::wait() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [this] { return done; });
}

bool Ticket::is_done() {
    std::lock_guard<std::mutex> lock(mutex);
    return done;
}

Executor::Executor() {
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) {
        fail(ErrorKind::Init, "eventfd() failed: cannot create the wake-up descriptor");
    }
    std::mutex started_mutex;
    std::condition_variable started_cv;
    bool started = false;
    thread_ = std::thread([&] {
        {
            std::lock_guard<std::mutex> lock(started_mutex);
            thread_id_ = static_cast<int64_t>(syscall(SYS_gettid));
            started = true;
        }
        started_cv.notify_one();
        run();
    });
    std::unique_lock<std::mutex> lock(started_mutex);
    started_cv.wait(lock, [&] { return started; });
}

Executor::~Executor() {
    shutdown();
    if (wake_fd_ >= 0) {
        close(wake_fd_);
    }
}

void Executor::run() {
    for (;;) {
        std::function<void()> job;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) {
                break;  // stopping and drained
            }
            job = std::move(queue_.front());
            queue_.pop_front();
        }
        job();
    }
    // Free the objects newest first: sessions before their contexts before their models.
    while (!objects_.empty()) {
        objects_.erase(std::prev(objects_.end()));
    }
}

std::shared_ptr<Ticket> Executor::submit(std::function<std::any()> job, bool notify) {
    auto ticket = std::make_shared<Ticket>();
    ticket->notify = notify;
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
        fail(ErrorKind::Closed, "the runtime is closed");
    }
    ticket->id = next_ticket_++;
    queue_.emplace_back([this, ticket, job = std::move(job)] {
        std::any value;
        std::exception_ptr error;
        try {
            value = job();
        } catch (...) {
            error = std::current_exception();
        }
        {
            std::lock_guard<std::mutex> tl(ticket->mutex);
            ticket->value = std::move(value);
            ticket->error = error;
            ticket->done = true;
        }
        ticket->cv.notify_all();
        if (ticket->notify) {
            {
                std::lock_guard<std::mutex> ql(mutex_);
                completed_.push_back(ticket->id);
            }
            uint64_t one = 1;
            ssize_t n = write(wake_fd_, &one, sizeof(one));
            (void) n;  // the counter saturating is harmless: readers drain the list anyway
        }
    });
    cv_.notify_one();
    return ticket;
}

void Executor::post_quiet(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
        return;
    }
    queue_.emplace_back(std::move(job));
    cv_.notify_one();
}

void Executor::shutdown() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closed_) {
            return;
        }
        closed_ = true;
        stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) {
        thread_.join();
    }
}

bool Executor::closed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_;
}

std::vector<uint64_t> Executor::take_completed() {
    uint64_t counter;
    while (read(wake_fd_, &counter, sizeof(counter)) > 0) {
    }
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<uint64_t> out;
    out.swap(completed_);
    return out;
}

uint64_t Executor::adopt(std::shared_ptr<void> object) {
    const uint64_t id = next_object_++;
    objects_.emplace(id, std::move(object));
    return id;
}

void Executor::erase(uint64_t id) {
    objects_.erase(id);
}

}  // namespace engine
