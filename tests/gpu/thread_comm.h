// Threads standing in for the ranks of a job on one GPU: a `Comm` with every collective, host and
// device, so that whole trainers of a parallel layout run side by side in one test process (two
// NCCL ranks cannot share a GPU). Host collectives publish a pointer, meet at a barrier and read
// the others' data; device collectives go through the host (stream synchronized first), which a
// captured graph cannot hold: these runs are eager. Results are summed in rank order, so every
// rank gets the same bits. Point-to-point transfers use a mailbox per (source, destination).
// A rank that fails marks the job failed (ThreadGroup::fail): every rank waiting in any of the
// job's communicators then stops with an error instead of waiting for it forever.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron::test {

// Whether a rank of the job failed: shared by the job's communicators (its splits too).
struct ThreadJob {
    std::atomic<bool> failed{false};
    void check() const { ST_CHECK(!failed.load(), "ThreadComm: another rank of the job failed"); }
};

// A barrier that stops waiting (with an error) once the job has failed.
class ThreadBarrier {
  public:
    ThreadBarrier(int n, std::shared_ptr<ThreadJob> job) : n_(n), job_(std::move(job)) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(mu_);
        const int64_t gen = generation_;
        if (++count_ == n_) {
            count_ = 0, ++generation_;
            cv_.notify_all();
            return;
        }
        while (generation_ == gen) {
            cv_.wait_for(lock, std::chrono::milliseconds(50));
            if (generation_ == gen) job_->check();
        }
    }

  private:
    int n_, count_ = 0;
    int64_t generation_ = 0;
    std::shared_ptr<ThreadJob> job_;
    std::mutex mu_;
    std::condition_variable cv_;
};

// What the ranks of one communicator share.
struct ThreadGroup {
    explicit ThreadGroup(int n, std::shared_ptr<ThreadJob> j = std::make_shared<ThreadJob>())
        : ranks(n), job(j), bar(n, j), posted(size_t(n)), mail(size_t(n * n)) {}
    // A rank failed: the others stop at their next wait.
    void fail() { job->failed = true; }
    struct Mail {
        const void* data = nullptr;
        int64_t bytes = 0;
        bool taken = false;
    };
    struct Post {
        const void* data = nullptr;
        const void* extra = nullptr;
        int64_t a = 0, b = 0;
    };
    int ranks;
    std::shared_ptr<ThreadJob> job;
    ThreadBarrier bar;
    std::vector<Post> posted;  // one per rank, valid between two barriers
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Mail> mail;                                  // [src * ranks + dst]
    std::map<int, std::shared_ptr<ThreadGroup>> new_groups;  // split: by color
};

class ThreadComm final : public Comm {
  public:
    ThreadComm(std::shared_ptr<ThreadGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return g_->ranks; }
    bool on_device() const override { return true; }
    std::string name() const override { return "threads"; }
    [[noreturn]] void abort(int code) override {
        std::fprintf(stderr, "ThreadComm: rank %d aborts the job (%d)\n", rank_, code);
        std::abort();
    }

    void allreduce_sum(float* x, int64_t n) override { reduce(x, n, sum_op<float>); }
    void allreduce_sum(double* x, int64_t n) override { reduce(x, n, sum_op<double>); }
    void broadcast(void* data, int64_t bytes, int root) override {
        publish({data, nullptr, bytes, 0});
        if (rank_ != root) std::memcpy(data, g_->posted[size_t(root)].data, size_t(bytes));
        g_->bar.arrive_and_wait();
    }
    std::vector<uint64_t> allgather(uint64_t value) override {
        publish({&value, nullptr, 0, 0});
        std::vector<uint64_t> out(static_cast<size_t>(size()));
        for (int r = 0; r < size(); ++r)
            out[size_t(r)] = *static_cast<const uint64_t*>(g_->posted[size_t(r)].data);
        g_->bar.arrive_and_wait();
        return out;
    }
    void alltoallv(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                   const std::vector<int64_t>& recv_bytes) override {
        publish({send, &send_bytes, 0, 0});
        int64_t to = 0;
        for (int r = 0; r < size(); ++r) {
            const auto& p = g_->posted[size_t(r)];
            const auto& theirs = *static_cast<const std::vector<int64_t>*>(p.extra);
            int64_t from = 0;
            for (int k = 0; k < rank_; ++k) from += theirs[size_t(k)];
            ST_CHECK(theirs[size_t(rank_)] == recv_bytes[size_t(r)], "ThreadComm: rank ", r,
                     " sends ", theirs[size_t(rank_)], " bytes, rank ", rank_, " expects ",
                     recv_bytes[size_t(r)]);
            std::memcpy(static_cast<char*>(recv) + to, static_cast<const char*>(p.data) + from,
                        size_t(recv_bytes[size_t(r)]));
            to += recv_bytes[size_t(r)];
        }
        g_->bar.arrive_and_wait();
    }
    std::unique_ptr<Comm> split(int color, int key) override {
        publish({nullptr, nullptr, color, key});
        std::vector<std::pair<int, int>> members;  // (key, parent rank) of my color
        for (int r = 0; r < size(); ++r)
            if (g_->posted[size_t(r)].a == color) members.emplace_back(g_->posted[size_t(r)].b, r);
        std::sort(members.begin(), members.end());
        const int mine =
            int(std::find(members.begin(), members.end(), std::pair{key, rank_}) - members.begin());
        if (mine == 0) {  // the color's first member makes the group
            std::lock_guard<std::mutex> lock(g_->mu);
            g_->new_groups[color] = std::make_shared<ThreadGroup>(int(members.size()), g_->job);
        }
        g_->bar.arrive_and_wait();
        auto group = [&] {
            std::lock_guard<std::mutex> lock(g_->mu);
            return g_->new_groups.at(color);
        }();
        g_->bar.arrive_and_wait();
        if (rank_ == 0) g_->new_groups.clear();
        g_->bar.arrive_and_wait();
        return std::make_unique<ThreadComm>(group, mine);
    }
    void sendrecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                  int src) override {
        transfer(send, send_bytes, dst, recv, recv_bytes, src,
                 [](void* d, const void* s, int64_t n) { std::memcpy(d, s, size_t(n)); });
    }

    void device_sendrecv(const void* send, int64_t send_bytes, int dst, void* recv,
                         int64_t recv_bytes, int src, void* stream) override {
        const ExecContext ctx{Device::CUDA, stream, nullptr};
        cuda::synchronize(ctx);  // the message is written
        transfer(send, send_bytes, dst, recv, recv_bytes, src,
                 [&](void* d, const void* s, int64_t n) {
                     cuda::copy_2d(ctx, d, 0, s, 0, n, 1);
                     cuda::synchronize(ctx);
                 });
    }
    void device_allreduce_sum(float* x, int64_t n, void* stream) override {
        on_host(x, n, stream, [&](float* h) { allreduce_sum(h, n); });
    }
    void device_allreduce_sum(int64_t* x, int64_t n, void* stream) override {
        on_host(x, n, stream, [&](int64_t* h) { reduce(h, n, sum_op<int64_t>); });
    }
    // Summed in fp32 in rank order, rounded to bf16 once.
    void device_allreduce_sum_bf16(void* x, int64_t n, void* stream) override {
        on_host(static_cast<bf16*>(x), n, stream, [&](bf16* h) {
            std::vector<float> f(static_cast<size_t>(n));
            for (int64_t i = 0; i < n; ++i) f[size_t(i)] = bf16_to_float(h[i]);
            allreduce_sum(f.data(), n);
            for (int64_t i = 0; i < n; ++i) h[i] = float_to_bf16(f[size_t(i)]);
        });
    }
    void device_allreduce_max(int32_t* x, int64_t n, void* stream) override {
        on_host(x, n, stream, [&](int32_t* h) {
            reduce(h, n, [](int32_t a, int32_t b) { return std::max(a, b); });
        });
    }
    void device_broadcast(void* data, int64_t bytes, int root, void* stream) override {
        on_host(static_cast<char*>(data), bytes, stream,
                [&](char* h) { broadcast(h, bytes, root); });
    }
    // Block r of every rank's buffer is rank r's.
    void device_allgather(void* data, int64_t bytes_per_rank, void* stream) override {
        on_host(static_cast<char*>(data), bytes_per_rank * size(), stream, [&](char* h) {
            publish({h, nullptr, 0, 0});
            for (int r = 0; r < size(); ++r)
                if (r != rank_)
                    std::memcpy(
                        h + r * bytes_per_rank,
                        static_cast<const char*>(g_->posted[size_t(r)].data) + r * bytes_per_rank,
                        size_t(bytes_per_rank));
            g_->bar.arrive_and_wait();
        });
    }
    // Every rank's blocks summed in rank order; this rank keeps its block.
    void device_reduce_scatter_sum(const float* send, float* recv, int64_t n,
                                   void* stream) override {
        const ExecContext ctx{Device::CUDA, stream, nullptr};
        std::vector<float> h(static_cast<size_t>(n * size()));
        cuda::synchronize(ctx);
        cuda::download(ctx, h.data(), send, int64_t(h.size() * sizeof(float)));
        reduce(h.data(), int64_t(h.size()), sum_op<float>);
        cuda::upload(ctx, recv, h.data() + rank_ * n, n * int64_t(sizeof(float)));
        cuda::synchronize(ctx);
    }
    // Block `me` of rank r's send lands in block r of this rank's receive.
    void device_alltoall(const void* send, void* recv, int64_t bytes_per_rank,
                         void* stream) override {
        const ExecContext ctx{Device::CUDA, stream, nullptr};
        const int64_t total = bytes_per_rank * size();
        std::vector<char> out(static_cast<size_t>(total)), in(static_cast<size_t>(total));
        cuda::synchronize(ctx);
        cuda::download(ctx, out.data(), send, total);
        publish({out.data(), nullptr, 0, 0});
        for (int r = 0; r < size(); ++r)
            std::memcpy(
                in.data() + r * bytes_per_rank,
                static_cast<const char*>(g_->posted[size_t(r)].data) + rank_ * bytes_per_rank,
                size_t(bytes_per_rank));
        g_->bar.arrive_and_wait();
        cuda::upload(ctx, recv, in.data(), total);
        cuda::synchronize(ctx);
    }

  private:
    template <typename T>
    static T sum_op(T a, T b) {
        return a + b;
    }
    // Posts this rank's entry and waits for every rank's; the caller reads, then meets the
    // others at the barrier again before its data may change.
    void publish(ThreadGroup::Post p) {
        g_->posted[size_t(rank_)] = p;
        g_->bar.arrive_and_wait();
    }
    template <typename T, typename Op>
    void reduce(T* x, int64_t n, Op op) {
        publish({x, nullptr, n, 0});
        std::vector<T> acc(static_cast<const T*>(g_->posted[0].data),
                           static_cast<const T*>(g_->posted[0].data) + n);
        for (int r = 1; r < size(); ++r) {
            const T* y = static_cast<const T*>(g_->posted[size_t(r)].data);
            for (int64_t i = 0; i < n; ++i) acc[size_t(i)] = op(acc[size_t(i)], y[i]);
        }
        g_->bar.arrive_and_wait();  // nobody overwrites what another rank still reads
        std::copy(acc.begin(), acc.end(), x);
    }
    // `n` elements at device address x to the host, `f` on them, back to the device.
    template <typename T, typename F>
    void on_host(T* x, int64_t n, void* stream, F f) {
        const ExecContext ctx{Device::CUDA, stream, nullptr};
        std::vector<T> h(static_cast<size_t>(n));
        cuda::synchronize(ctx);
        cuda::download(ctx, h.data(), x, n * int64_t(sizeof(T)));
        f(h.data());
        cuda::upload(ctx, x, h.data(), n * int64_t(sizeof(T)));
        cuda::synchronize(ctx);
    }
    // Blocking like NCCL's grouped send/recv: the message is posted, the receive waits for the
    // peer's post and copies it, the send waits until the peer took it.
    template <typename Copy>
    void transfer(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                  int src, Copy copy) {
        const bool out = dst >= 0 && send_bytes > 0, in = src >= 0 && recv_bytes > 0;
        std::unique_lock<std::mutex> lock(g_->mu);
        ThreadGroup::Mail* posted = nullptr;
        if (out) {
            posted = &g_->mail[size_t(rank_ * size() + dst)];
            ST_CHECK(posted->data == nullptr, "ThreadComm: a second message to rank ", dst,
                     " before the first was taken");
            *posted = {send, send_bytes, false};
            g_->cv.notify_all();
        }
        if (in) {
            ThreadGroup::Mail& m = g_->mail[size_t(src * size() + rank_)];
            wait(lock, [&] { return m.data != nullptr && !m.taken; });
            ST_CHECK(m.bytes == recv_bytes, "ThreadComm: rank ", rank_, " expects ", recv_bytes,
                     " bytes from rank ", src, ", which sends ", m.bytes);
            lock.unlock();
            copy(recv, m.data, recv_bytes);
            lock.lock();
            m.taken = true;
            g_->cv.notify_all();
        }
        if (out) {
            wait(lock, [&] { return posted->taken; });
            *posted = {};
        }
    }

    // Waits on the mailbox until `ready`, or stops with an error once the job has failed.
    template <typename Pred>
    void wait(std::unique_lock<std::mutex>& lock, Pred ready) {
        while (!g_->cv.wait_for(lock, std::chrono::milliseconds(50), ready)) g_->job->check();
    }

    std::shared_ptr<ThreadGroup> g_;
    int rank_;
};

}  // namespace sparsetron::test
